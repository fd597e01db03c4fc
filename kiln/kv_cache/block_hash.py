"""Chained block hashes for prefix caching.

hash(block i) = xxh3_128(seed=fixed)(parent hash | the block's token ids | extra keys).
A fixed seed makes hashes agree across processes and restarts; the chain makes a block's
hash name its whole prefix, so equal hashes mean equal KV. Extra keys (the cache salt,
the LoRA adapter's fingerprint) go into the first block only, which is enough to
separate every later block too: two adapters never share KV.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np
import xxhash

if TYPE_CHECKING:
    from kiln.request import Request

_SEED = 0x6B696C6E  # "kiln"
NONE_HASH = xxhash.xxh3_128(b"kiln-none-hash", seed=_SEED).digest()


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = xxhash.xxh3_128(seed=_SEED)
    h.update(parent or NONE_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


def first_block_extra(request: Request,
                      adapter_keys: Mapping[int, bytes] | None = None) -> bytes:
    """The cache salt, and the request's adapter: by its files' fingerprint where the
    engine registered one (`adapter_keys`), else by its id."""
    extra = request.cache_salt.encode() if request.cache_salt else b""
    lid = request.lora_int_id
    if lid:
        key = (adapter_keys or {}).get(lid)
        extra += b"\x00lora:" + (key if key is not None else str(lid).encode())
    return extra


class BlockHasher:
    """Keeps `request.block_hashes` covering every full block of its known tokens.
    `adapter_keys` (lora_int_id -> fingerprint, kept by the engine's adapter registry):
    an id means one adapter only within one engine's lifetime, while hashes outlive it
    in a persistent KV tier."""

    def __init__(self, block_size: int, adapter_keys: Mapping[int, bytes] | None = None
                 ) -> None:
        self.block_size = block_size
        self.adapter_keys = {} if adapter_keys is None else adapter_keys

    def __call__(self, request: Request) -> None:
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            extra = first_block_extra(request, self.adapter_keys) if i == 0 else b""
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     tokens[i * bs:(i + 1) * bs], extra))
