"""KVLayout: what one stored block is, and the namespace that keeps incompatible blocks
apart.

A block hash names a token prefix, not the KV it produced: the same tokens give other KV
under another model, weights file, dtype, quantization, block size or tensor-parallel
rank. The namespace digests all of those (and the format version), so two engines share
blocks exactly when their KV for equal tokens is equal.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass(frozen=True, slots=True)
class KVLayout:
    namespace: str  # hex digest of `identity`
    block_shape: tuple[int, ...]  # [num_layers, 2 (K, V), block_size, kv_heads, head_size]
    dtype: torch.dtype
    identity: str  # the JSON the namespace digests (written beside the blocks)

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def namespace_digest(self) -> bytes:
        return bytes.fromhex(self.namespace)


def model_fingerprint(path: Path) -> dict[str, Any]:
    """The checkpoint's identity without reading its weights: config.json's text and
    each weight file's name, size and modification time (a rewritten file is another
    model; the same file shared by many processes is one)."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    config = path / "config.json" if path.is_dir() else None
    return {"path": str(path),
            "config": config.read_text() if config is not None and config.exists() else "",
            "weights": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def make_layout(fingerprint: dict[str, Any], *, num_layers: int, block_size: int,
                num_kv_heads: int, head_size: int, dtype: torch.dtype,
                quantization: object, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    shape = (num_layers, 2, block_size, num_kv_heads, head_size)
    identity = json.dumps({"format": FORMAT_VERSION, "model": fingerprint,
                           "dtype": str(dtype), "block_shape": shape,
                           "quantization": quantization or "none",
                           "tp": [tp_rank, tp_size]}, sort_keys=True)
    namespace = xxhash.xxh3_128(identity.encode()).hexdigest()
    return KVLayout(namespace, shape, dtype, identity)
