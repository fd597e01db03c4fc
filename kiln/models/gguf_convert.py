"""Convert a GGUF file (as llama.cpp writes them) into a Hugging Face model directory.

The result is a plain fp32 checkpoint of the file's architecture (`llama` (Llama or Mixtral),
`gemma2`, `gemma3`, `qwen2moe`: see gguf_arch.py for what differs) with config.json, model.safetensors,
generation_config.json and, when the GGUF carries one, the tokenizer with its chat template, so
the rest of kiln only ever deals with Hugging Face directories.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from filelock import FileLock
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kiln.models.gguf_index import open_gguf
from kiln.models.gguf_arch import (ARCHITECTURES, EXPERT_STACKS, GGUFArch, Meta, architecture,
                                   hf_name, unpermute_rope_rows)

if TYPE_CHECKING:
    from transformers import GenerationConfig

logger = logging.getLogger(__name__)

def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` into the Hugging Face directory `out_dir` once, and return `out_dir`.

    Safe to call from several processes at once: a file lock serialises them and the directory only
    appears (by an atomic rename) once it is complete, so `config.json` existing means "done".
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / "config.json").is_file():  # another process finished while we waited
            return out_dir
        if out_dir.exists() and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists, is not empty and holds no config.json; refusing to overwrite it")
        # A plain mkdir (not mkdtemp, which forces mode 0700) so the cache honours the umask.
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp_dir.mkdir()
        try:
            started = time.monotonic()
            logger.info("Converting %s into %s", gguf_path, out_dir)
            _convert_into(gguf_path, tmp_dir, progress=progress)
            os.replace(tmp_dir, out_dir)  # atomic; an empty out_dir is replaced too
            logger.info("Converted %s in %.1f s", gguf_path.name, time.monotonic() - started)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # no-op after a successful rename
    return out_dir


def _convert_into(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    try:
        reader = open_gguf(gguf_path)
    except ValueError as error:  # e.g. "GGUF magic invalid"
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({error})") from error
    arch = architecture(reader, gguf_path)
    meta = Meta(reader, arch.name)
    config = arch.config(meta)
    tensors = iter_hf_tensors(reader, config, arch, desc=f"Converting {gguf_path.name}", progress=progress)
    state = dict(tensors)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _save_config(config, out_dir)
    # safetensors creates its file 0600; give it the umask-derived mode Python used for config.json.
    shutil.copymode(out_dir / "config.json", out_dir / "model.safetensors")
    _generation_config(config.bos_token_id, config.eos_token_id, config.pad_token_id).save_pretrained(out_dir)
    add_sampling_defaults(out_dir, gguf_sampling_defaults(meta), replace=True)
    if meta.field("tokenizer.ggml.model") is None:
        logger.warning("%s carries no tokenizer; writing weights and config only", gguf_path.name)
    else:
        _save_tokenizer(gguf_path, out_dir, config)


def iter_hf_tensors(
    reader: gguf.GGUFReader, config: Any, arch: GGUFArch = ARCHITECTURES["llama"], *,
    desc: str = "Dequantizing", progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, fp32 tensor) for every GGUF tensor, with llama.cpp's changes undone."""
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", disable=not progress):
        if tensor.name == "rope_freqs.weight":
            # llama3-style rope factors have no LlamaConfig equivalent we can derive from the file.
            logger.warning("ignoring rope_freqs.weight: per-dimension rope factors are not converted")
            continue
        name, kind = hf_name(tensor.name, arch)
        # GGUF lists dimensions innermost-first; torch wants them outermost-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if arch.permute_rope and kind == "attn_q":
            weights = unpermute_rope_rows(weights, config.num_attention_heads)
        elif arch.permute_rope and kind == "attn_k":
            weights = unpermute_rope_rows(weights, config.num_key_value_heads)
        elif arch.norm_shift and name.endswith("norm.weight"):
            weights = weights - arch.norm_shift
        elif kind == "ffn_gate_inp_shexp":
            weights = weights.reshape(1, -1)  # HF's [1, hidden] gate; files store [hidden]
        if kind in EXPERT_STACKS:  # [E, N, K] -> one [N, K] tensor per expert
            for e, w in enumerate(weights):
                yield name.format(e), torch.from_numpy(np.ascontiguousarray(w))
            continue
        yield name, torch.from_numpy(np.ascontiguousarray(weights))


def _save_config(config: Any, out_dir: Path) -> None:
    config.save_pretrained(out_dir)
    # transformers 5 writes "dtype"; older readers look for "torch_dtype", so write both.
    _edit_json(out_dir / "config.json", lambda data: data.update(torch_dtype="float32"))


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# llama.cpp's `general.sampling.*` keys and the generation_config.json key each one sets.
# The others (mirostat*, xtc_*, penalty_last_n, sequence) have no kiln equivalent: logged.
# Note llama.cpp's repeat penalty looks back `penalty_last_n` tokens (64 by default) while
# kiln's, like transformers' and vLLM's, covers the prompt and every generated token.
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(meta: Meta) -> dict[str, Any]:
    """The sampling defaults a GGUF file declares, as generation-config keys."""
    out: dict[str, Any] = {}
    for key in meta.reader.fields:
        if not key.startswith("general.sampling."):
            continue
        value = meta.field(key)
        if key not in _GGUF_SAMPLING:
            logger.warning("GGUF %s=%r has no kiln equivalent; not applied", key, value)
            continue
        # float32 in the file: 0.8 reads back as 0.800000011920929
        out[_GGUF_SAMPLING[key]] = round(value, 6) if isinstance(value, float) else value
    return _valid_sampling(out)


# The ranges SamplingParams accepts (kiln.sampling.params), per generation-config key.
_SAMPLING_RANGES: dict[str, Callable[[float], bool]] = {
    "temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= -1 and float(v).is_integer(), "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0}


def _valid_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields kiln accepts; one llama.cpp allows but kiln refuses (a negative
    temperature, top_p 0) is logged and left out, so it cannot stop every later start."""
    kept: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, (int, float)) and _SAMPLING_RANGES[key](value):
            kept[key] = int(value) if key == "top_k" else value
        else:
            logger.warning("GGUF sampling default %s=%r is outside what kiln accepts; not "
                           "applied", key, value)
    return kept


def add_sampling_defaults(model_dir: Path, fields: dict[str, Any], *, replace: bool) -> bool:
    """Write sampling defaults into `model_dir`'s generation_config.json; with
    replace=False only when the file sets none yet (one that sets any was chosen by
    someone). `do_sample` follows the temperature so transformers samples alike. Returns
    whether the file changed."""
    path = model_dir / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if not fields or (not replace and any(k in data for k in _SAMPLING_NAMES)):
        return False
    data.update(fields)
    data["do_sample"] = float(data.get("temperature", 1.0)) > 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    return True


_SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_config(bos: int | None, eos: int | None, pad: int | None) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _save_tokenizer(gguf_path: Path, out_dir: Path, config: Any) -> None:
    """Let transformers build the fast tokenizer (vocab, merges, special tokens, chat template)."""
    tokenizer = _tokenizer_class(gguf_path, config).from_pretrained(
        str(gguf_path.parent.resolve()), gguf_file=gguf_path.name, local_files_only=True
    )
    # Otherwise an "infinite" sentinel is saved.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)

    def drop_load_time_flags(data: dict[str, Any]) -> None:
        # Flags describing how *this* load happened; they do not belong in the saved tokenizer.
        for key in ("is_local", "local_files_only"):
            data.pop(key, None)

    _edit_json(out_dir / "tokenizer_config.json", drop_load_time_flags)


def _tokenizer_class(gguf_path: Path, config: Any) -> Any:
    """The class `AutoTokenizer` picks for this file, found without its config step.

    Given a GGUF file, `AutoTokenizer` rebuilds the model config with gguf's own reader
    (for llama files: about 3 s on the default model's 49k-token vocabulary, which only
    the tokenizer needs) and, with no tokenizer_config.json beside the file and no
    `tokenizer_class` in the config, takes `TOKENIZER_MAPPING[type(config)]`, else
    `TokenizersBackend`. kiln already holds the config, so it looks the class up itself
    (0.3 s); anything else is left to `AutoTokenizer`. tests/test_gguf_convert.py checks
    that both write the same files."""
    from transformers import AutoTokenizer

    try:  # transformers 5's names; an older one resolves the class itself
        from transformers.models.auto.tokenization_auto import (TOKENIZER_MAPPING,
                                                                TokenizersBackend)
    except ImportError:
        return AutoTokenizer
    if (gguf_path.parent / "tokenizer_config.json").exists() or \
            getattr(config, "tokenizer_class", None):
        return AutoTokenizer
    chosen = TOKENIZER_MAPPING.get(type(config), TokenizersBackend) or TokenizersBackend
    return AutoTokenizer if chosen.__name__ == "MistralCommonBackend" else chosen
