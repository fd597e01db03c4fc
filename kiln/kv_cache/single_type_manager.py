"""One manager per KV-cache group: which blocks each request holds in that group, its
prefix-cache hits, and (for a sliding window) the blocks that fall out of reach.

Managers are found by spec class through a registry that walks the MRO, so a spec
subclass inherits its base's manager unless it registers its own (vLLM's
KVCacheSpecRegistry). All managers share one BlockPool; a group's cache entries are
keyed by (block hash, group) so that equal tokens in two groups name two blocks.

A request's block list always spans every position it has computed: positions a
sliding window no longer needs hold the null block (block 0), never read unmasked.
"""
from __future__ import annotations

from typing import ClassVar

from kiln.kv_cache.block_pool import BlockPool, KVCacheBlock
from kiln.kv_cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def group_hash(block_hash: bytes, group: int) -> bytes:
    """The pool key of a block hash in `group` (group 0 keeps the plain hash, which is
    also what a KV connector's tier names)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class SingleTypeManager:
    spec_type: ClassVar[type[KVCacheSpec]]

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group: int) -> None:
        self.spec, self.pool, self.group = spec, pool, group
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}  # blocks of each request already registered

    def find_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """The longest cached prefix of at most `max_blocks` blocks (null blocks where
        this group needs no KV)."""
        raise NotImplementedError

    def _cached(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.get_cached_block(group_hash(block_hash, self.group))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future query of the request reads (none for full attention)."""

    def num_needed(self, request_id: str, num_hits: int, num_tokens: int) -> int:
        """New blocks for the request to span `num_tokens` tokens after taking
        `num_hits` hit blocks."""
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - held - num_hits)

    def append(self, request_id: str, hits: list[KVCacheBlock],
               new_blocks: list[KVCacheBlock]) -> None:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        blocks.extend(hits)
        blocks.extend(new_blocks)

    def cache_full_blocks(self, request_id: str, block_hashes: list[bytes],
                          num_tokens: int) -> None:
        """Register the blocks this step fills (their KV is written in this step's
        forward, before any later step can read it through a hit). Null blocks (hits
        out of a window) are skipped: the pool never caches them."""
        blocks = self.req_to_blocks[request_id]
        full = min(num_tokens // self.block_size, len(block_hashes))
        start = self._num_cached.get(request_id, 0)
        for i in range(start, full):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], group_hash(block_hashes[i], self.group))
        self._num_cached[request_id] = max(start, full)

    def free(self, request_id: str) -> None:
        """Release every block, tail first (tails are the least reusable)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeManager):
    spec_type = FullAttentionSpec

    def find_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self._cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeManager):
    spec_type = SlidingWindowSpec

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group: int) -> None:
        super().__init__(spec, pool, group)
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.sliding_window
        # A hit ending at block boundary L lets the query at L see L - window + 1 ..:
        # the window - 1 tokens before it, in this many whole blocks.
        self._contiguous = max(1, -(-(self.window - 1) // self.block_size))

    def find_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        """Scan from the right for `_contiguous` cached blocks in a row; the blocks
        before them are out of the window (null). Without such a run, the cached prefix
        counts if it is the run that starts at block 0."""
        null = self.pool.null_block
        hits = [null] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self._cached(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self._contiguous:
                return hits[: i + run]
        return hits[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The next query sits at `num_computed_tokens` and sees keys from
        num_computed_tokens - window + 1 on: blocks wholly before that go back to the
        pool (hashed ones stay cached) and become the null block in the list."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first_needed = max(0, num_computed_tokens - self.window + 1) // self.block_size
        null = self.pool.null_block
        freed = []
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was freed already
            freed.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(freed)


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeManager]] = {}


def register_manager(manager: type[SingleTypeManager]) -> type[SingleTypeManager]:
    _MANAGERS[manager.spec_type] = manager
    return manager


for _m in (FullAttentionManager, SlidingWindowManager):
    register_manager(_m)


def manager_class(spec: KVCacheSpec) -> type[SingleTypeManager]:
    """The manager of the nearest registered class in the spec's MRO; a ValueError at
    start-up (not an assert: it must survive `python -O`) when there is none."""
    for cls in type(spec).__mro__:
        if cls in _MANAGERS:
            return _MANAGERS[cls]
    raise ValueError(f"no KV-cache manager is registered for {type(spec).__name__}; "
                     f"registered: {', '.join(c.__name__ for c in _MANAGERS)} "
                     "(kiln.kv_cache.single_type_manager.register_manager)")

