"""Resolving which quantization a model runs with, once at start-up.

Three sources can speak: the user (`--quantization` / `LLM(quantization=...)`), the
checkpoint's `quantization_config` in config.json, and the tensor types of a GGUF file.
They must agree; a conflict is a `ValueError` that names both. The user's `"none"` on a
GGUF file dequantizes it at load (the converted float checkpoint, as before).
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

from kiln.config.quantization import CHOICES, QuantizationConfig
from kiln.models import gguf_index

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@functools.lru_cache(maxsize=2)
def open_gguf(path: Path) -> object:
    """The file's tensor table and metadata (`kiln.models.gguf_index.open_gguf`), read once
    per process: start-up needs them twice, the tensor types here and the blocks in
    gguf_weights.py."""
    return gguf_index.open_gguf(path)


def gguf_tensor_types(path: Path) -> dict[str, int]:
    return dict(Counter(t.tensor_type.name for t in open_gguf(path).tensors))


def _checkpoint_method(model_dir: Path) -> str | None:
    """The quantization a HF checkpoint declares (None: a float checkpoint). The one
    pre-quantized format kiln loads is compressed-tensors W8A16 (llm-compressor's): int8
    weights, symmetric, one scale per output channel, activations unquantized; any other
    is a start-up error, never a silent float run."""
    config = model_dir / "config.json"
    if not config.is_file():
        return None
    qc = json.loads(config.read_text()).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors" and _is_w8a16_channel(qc):
        return "int8-channel"
    raise ValueError(f"{config}: quantization_config quant_method={method!r} (format "
                     f"{qc.get('format')!r}) is not supported; kiln loads compressed-tensors "
                     "W8A16 (int-quantized, 8-bit symmetric per-channel weights), quantizes "
                     "float checkpoints at load (--quantization int8) and runs GGUF files")


def _is_w8a16_channel(qc: dict) -> bool:
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("format") not in ("int-quantized", "naive-quantized") or len(groups) != 1:
        return False
    w = groups[0].get("weights") or {}
    return (w.get("num_bits") == 8 and w.get("type") == "int" and bool(w.get("symmetric"))
            and w.get("strategy") == "channel" and not groups[0].get("input_activations"))


def resolve_quantization(requested: str | None, model_dir: Path,
                         gguf_path: Path | None) -> QuantizationConfig:
    """One config from the three sources (see the module docstring)."""
    if requested is not None and requested not in CHOICES:
        raise ValueError(f"quantization={requested!r} is not supported; use one of "
                         f"{', '.join(CHOICES)} (or leave it unset to follow the checkpoint)")
    types = gguf_tensor_types(gguf_path) if gguf_path is not None else {}
    gguf_quantized = any(t not in _FLOAT_TYPES for t in types)
    checkpoint = "gguf" if gguf_quantized else _checkpoint_method(model_dir)
    where = (f"the GGUF file {gguf_path.name} (tensor types {', '.join(sorted(types))})"
             if gguf_quantized else f"{model_dir}/config.json quantization_config")
    pre = checkpoint == "int8-channel"
    if requested == "none":
        return QuantizationConfig(None, "--quantization none", gguf_types=types,
                                  prequantized=pre)
    if requested is None:
        if checkpoint is None:
            return QuantizationConfig(None, "checkpoint")
        return QuantizationConfig(checkpoint, where, gguf_path if gguf_quantized else None,
                                  types, prequantized=pre)
    if checkpoint is not None and checkpoint != requested:
        fix = (" (to int8-quantize this model, pass the float checkpoint kiln converted "
               f"from it: --model {model_dir})" if checkpoint == "gguf" else "")
        raise ValueError(f"quantization={requested!r} conflicts with {where}, which is "
                         f"already {checkpoint}-quantized{fix}; drop --quantization to run "
                         f"it as {checkpoint}")
    if requested == "gguf" and not gguf_quantized:
        raise ValueError("quantization='gguf' needs a quantized .gguf model file; "
                         f"{gguf_path or model_dir} is not one")
    return QuantizationConfig(requested, f"--quantization {requested}",
                              gguf_path if requested == "gguf" else None, types,
                              prequantized=pre)
