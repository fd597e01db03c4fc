"""Chained block hashes for prefix caching.

hash(block i) = xxh3_128(seed=fixed)(parent hash | the block's token ids | extra keys).
A fixed seed makes hashes agree across processes and restarts; the chain makes a block's
hash name its whole prefix, so equal hashes mean equal KV. Extra keys (the cache salt)
(the cache salt, the LoRA adapter's id) go into the first block only, which is enough to
separate every later block too: two adapters never share KV.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

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


def first_block_extra(request: Request) -> bytes:
    extra = request.cache_salt.encode() if request.cache_salt else b""
    if request.lora_int_id:
        extra += b"\x00lora:" + str(request.lora_int_id).encode()
    return extra


class BlockHasher:
    """Keeps `request.block_hashes` covering every full block of its known tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> None:
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            extra = first_block_extra(request) if i == 0 else b""
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     tokens[i * bs:(i + 1) * bs], extra))
