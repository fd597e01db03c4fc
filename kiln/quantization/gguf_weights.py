"""GGUF block formats into kiln's kernel formats, per linear layer, at load.

The model first loads the float checkpoint kiln converted from the file (norms, the
embedding table, and every layer a kernel cannot run); then each linear whose GGUF
tensors are all of one native type (Q8_0, or Q4_0/Q4_1) takes those blocks, repacked
bit for bit: codes, fp16 scales and offsets exactly as stored. Q/K rows are
un-permuted like the float conversion (rows move whole; blocks run along K). Other
types (K-quants, ...) stay dequantized in the activation dtype, with one warning that
names them: a stated fallback, never a silent one.
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln.models.gguf_arch import (EXPERT_STACKS, GGUFArch, architecture, hf_name,
                                   unpermute_rope_rows)
from kiln.ops.quant_packing import QuantWeight, pack_q4_bytes, pack_q8, packable_shape

logger = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_FAMILY = {"Q8_0": "q8", "Q4_0": "q4", "Q4_1": "q4"}


def decode(tensor: object, q4_bytes: bool = False
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's (codes [N, K], fp16 scales [N, K/32], fp16 offsets or None),
    with value = code * scale (+ offset); Q4_0's offset is -8 * scale. `q4_bytes`: a Q4
    tensor's codes stay the file's packed bytes [N, K/2] (`pack_q4_bytes` takes them)."""
    kind = tensor.tensor_type.name  # type: ignore[attr-defined]
    data = np.asarray(tensor.data)  # type: ignore[attr-defined]  # [N, bytes per row]
    n = data.shape[0]
    if kind == "Q8_0":
        b = data.reshape(n, -1, 34)
        d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
        return np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1), d, None
    head = 2 if kind == "Q4_0" else 4
    b = data.reshape(n, -1, head + 16)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
    m = (np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0] if kind == "Q4_1"
         else (d.astype(np.float32) * -8).astype(np.float16))
    qs = b[..., head:]
    if q4_bytes:
        return qs.reshape(n, -1), d, m
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(n, -1)
    return codes, d, m


def _rope_heads(kind: str, model: nn.Module, arch: GGUFArch) -> int | None:
    if not arch.permute_rope:
        return None
    if kind == "attn_q":
        return model.config.num_heads
    return model.config.num_kv_heads if kind == "attn_k" else None


def _layer_tensors(model: nn.Module, reader: object,
                   arch: GGUFArch) -> dict[str, list[tuple[object, str]]]:
    """{module name: [(GGUF tensor, kind) in the layer's row order]} for the 2-D weights
    (expert stacks are not linears: they load from the float checkpoint)."""
    found: dict[str, dict[str | None, tuple[object, str]]] = {}
    for t in reader.tensors:  # type: ignore[attr-defined]
        if not t.name.endswith(".weight") or t.name == "rope_freqs.weight":
            continue
        name, kind = hf_name(t.name, arch)
        if kind in EXPERT_STACKS:
            continue
        names = [name]
        if name == "model.embed_tokens.weight" and model.config.tie_word_embeddings:
            names = ["lm_head.weight"]  # the tied lm_head reads the embedding's blocks
        for n in names:
            if n == "lm_head.weight" and getattr(model, "lm_head", None) is None:
                continue  # a pipeline stage before the last: no LM head here
            target = model.checkpoint_name(n) if n != "lm_head.weight" else (n, None)
            if target is not None:
                pname, shard = target
                found.setdefault(pname.rpartition(".")[0], {})[shard] = (t, kind)
    ordered = {}
    for module, shards in found.items():
        layer = model.get_submodule(module)
        order = list(getattr(layer, "shards", {None: None}))
        ordered[module] = [shards[s] for s in order if s in shards]
    return ordered


def _pack(model: nn.Module, parts: list[tuple[object, str]], arch: GGUFArch) -> QuantWeight:
    decoded = []
    for tensor, kind in parts:
        codes, d, m = decode(tensor, q4_bytes=True)  # rows move whole either way
        heads = _rope_heads(kind, model, arch)
        if heads is not None:
            codes, d = unpermute_rope_rows(codes, heads), unpermute_rope_rows(d, heads)
            m = None if m is None else unpermute_rope_rows(m, heads)
        decoded.append((codes, d, m))
    cat = [np.concatenate(arrays) for arrays in zip(*[(c, d) for c, d, _ in decoded])]
    q, d = torch.from_numpy(cat[0]), torch.from_numpy(cat[1])
    if decoded[0][2] is None:
        return pack_q8(q, d)
    return pack_q4_bytes(q, d, torch.from_numpy(np.concatenate([m for _, _, m in decoded])))


def gguf_linears(model: nn.Module, path: Path) -> tuple[dict[str, QuantWeight], list[str]]:
    """({module name: packed weight} for every linear that runs natively, [warnings])."""
    from kiln.models.layers import Linear
    from kiln.quantization.resolve import open_gguf

    reader = open_gguf(path)
    arch = architecture(reader, path)
    native: dict[str, QuantWeight] = {}
    fallback: Counter[str] = Counter()
    for module, parts in _layer_tensors(model, reader, arch).items():
        layer = model.get_submodule(module)
        if not isinstance(layer, Linear):
            continue
        kinds = {t.tensor_type.name for t, _ in parts}
        if kinds <= set(_FLOAT_TYPES):
            continue  # a float tensor runs in the activation dtype, as it says
        families = {_FAMILY.get(k) for k in kinds}
        if len(families) != 1 or None in families:
            fallback[f"GGUF type {'+'.join(sorted(kinds))} (no native kernel; native: "
                     f"{', '.join(_FAMILY)})"] += 1
        elif not packable_shape(*layer.weight.shape):
            fallback[f"shape {tuple(layer.weight.shape)} (the kernel needs rows % 16 == 0 "
                     "and columns % 32 == 0)"] += 1
        else:
            native[module] = _pack(model, parts, arch)
    notes = [f"{n} quantized linear layer(s) run dequantized at load in the activation "
             f"dtype: {why}" for why, n in fallback.items()]
    return native, notes
