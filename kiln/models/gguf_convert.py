"""Convert a llama-architecture GGUF file (as llama.cpp writes them) into a Hugging Face model directory.

The result is a plain fp32 `LlamaForCausalLM` checkpoint (config.json, model.safetensors,
generation_config.json and, when the GGUF carries one, the tokenizer with its chat template), so
the rest of kiln only ever deals with Hugging Face directories.
"""

from __future__ import annotations

import json
import logging
import os
import re
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

if TYPE_CHECKING:
    from transformers import GenerationConfig, LlamaConfig

logger = logging.getLogger(__name__)

_ARCH = "llama"
_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
        reader = gguf.GGUFReader(gguf_path)
    except ValueError as error:  # e.g. "GGUF magic invalid"
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({error})") from error
    arch = _field(reader, "general.architecture")
    if arch != _ARCH:
        raise ValueError(f"{gguf_path}: only the '{_ARCH}' GGUF architecture is supported, this file is '{arch}'")
    config = build_llama_config(reader)
    state = dict(iter_hf_tensors(reader, config, desc=f"Converting {gguf_path.name}", progress=progress))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _save_config(config, out_dir)
    # safetensors creates its file 0600; give it the umask-derived mode Python used for config.json.
    shutil.copymode(out_dir / "config.json", out_dir / "model.safetensors")
    _generation_config(config.bos_token_id, config.eos_token_id, config.pad_token_id).save_pretrained(out_dir)
    if _field(reader, "tokenizer.ggml.model") is None:
        logger.warning("%s carries no tokenizer; writing weights and config only", gguf_path.name)
    else:
        _save_tokenizer(gguf_path, out_dir, config.max_position_embeddings)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def build_llama_config(reader: gguf.GGUFReader) -> LlamaConfig:
    """A `transformers.LlamaConfig` from the GGUF metadata and tensor list."""
    from transformers import LlamaConfig  # deferred: importing transformers costs seconds

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{_ARCH}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=_vocab_size(reader, tensors),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters=_rope_parameters(reader),
        # llama.cpp drops output.weight when the model ties it to the embedding.
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )


def _vocab_size(reader: gguf.GGUFReader, tensors: dict[str, gguf.ReaderTensor]) -> int:
    # The embedding's row count is what the weights need; the token list is the fallback.
    if "token_embd.weight" in tensors:
        return int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are innermost-first
    tokens = reader.get_field("tokenizer.ggml.tokens")
    return len(tokens.data) if tokens is not None else int(_field(reader, f"{_ARCH}.vocab_size"))


def _rope_parameters(reader: gguf.GGUFReader) -> dict[str, Any]:
    """transformers 5 keeps rope_theta and any scaling together in `rope_parameters`."""
    params: dict[str, Any] = {"rope_theta": float(_field(reader, f"{_ARCH}.rope.freq_base", 10000.0))}
    kind = _field(reader, f"{_ARCH}.rope.scaling.type", "none")
    factor = _field(reader, f"{_ARCH}.rope.scaling.factor") or _field(reader, f"{_ARCH}.rope.scale_linear")
    if kind == "none" and factor is not None and float(factor) != 1.0:
        kind = "linear"  # older files only store rope.scale_linear
    if kind == "none" or factor is None:
        return params | {"rope_type": "default"}
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    params |= {"rope_type": kind, "factor": float(factor)}
    original = _field(reader, f"{_ARCH}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def iter_hf_tensors(
    reader: gguf.GGUFReader, config: LlamaConfig, *, desc: str = "Dequantizing", progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, fp32 tensor) for every GGUF tensor, with q/k rows un-permuted."""
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", disable=not progress):
        if tensor.name == "rope_freqs.weight":
            # llama3-style rope factors have no LlamaConfig equivalent we can derive from the file.
            logger.warning("ignoring rope_freqs.weight: per-dimension rope factors are not converted")
            continue
        name, kind = hf_name(tensor.name)
        # GGUF lists dimensions innermost-first; torch wants them outermost-first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if kind == "attn_q":
            weights = unpermute_rope_rows(weights, config.num_attention_heads)
        elif kind == "attn_k":
            weights = unpermute_rope_rows(weights, config.num_key_value_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(weights))


def hf_name(gguf_name: str) -> tuple[str, str]:
    """Map a GGUF tensor name to (Hugging Face name, GGUF kind such as 'attn_q')."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}", kind
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}", stem
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")


def unpermute_rope_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q_proj / k_proj (weights or biases).

    Hugging Face's rope pairs dimension i with i + head_dim/2 (rotate_half); llama.cpp's pairs
    2i with 2i+1. The converter therefore stores HF row [head, j, i] (j in {0, 1}, i < head_dim/2)
    at position [head, i, j]; swapping the two inner axes back restores the HF order. For k_proj
    `n_heads` is the number of key/value heads.
    """
    half = weights.shape[0] // n_heads // 2
    grouped = weights.reshape(n_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _save_config(config: LlamaConfig, out_dir: Path) -> None:
    config.save_pretrained(out_dir)
    # transformers 5 writes "dtype"; older readers look for "torch_dtype", so write both.
    _edit_json(out_dir / "config.json", lambda data: data.update(torch_dtype="float32"))


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _generation_config(bos: int | None, eos: int | None, pad: int | None) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_length: int) -> None:
    """Let transformers build the fast tokenizer (vocab, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent.resolve()), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.model_max_length = max_length  # otherwise an "infinite" sentinel is saved
    tokenizer.save_pretrained(out_dir)

    def drop_load_time_flags(data: dict[str, Any]) -> None:
        # Flags describing how *this* load happened; they do not belong in the saved tokenizer.
        for key in ("is_local", "local_files_only"):
            data.pop(key, None)

    _edit_json(out_dir / "tokenizer_config.json", drop_load_time_flags)
