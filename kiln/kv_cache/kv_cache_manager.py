"""KVCacheManager: the ledger of which blocks each request holds, per KV-cache group,
and prefix-cache hits (the hybrid coordinator).

One manager per group (kiln.kv_cache.single_type_manager), all over one BlockPool.
Block lists and hits are tuples with one entry per group. A prefix hit must hold in
every group, so its length is a fixed point: each group's longest hit no longer than
the current length, until no group shortens it (full attention is prefix-closed; a
sliding window may need a shorter length to find its window cached).
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.kv_cache.block_pool import BlockPool, KVCacheBlock
from kiln.kv_cache.kv_cache_spec import KVCacheGroupSpec, KVCacheSpec
from kiln.kv_cache.single_type_manager import SingleTypeManager, manager_class
from kiln.request import Request

BlockLists = tuple[list[KVCacheBlock], ...]  # one list per group


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroupSpec] | KVCacheSpec, num_blocks: int,
                 enable_caching: bool = False) -> None:
        if isinstance(groups, KVCacheSpec):  # one group: every layer the same spec
            groups = [KVCacheGroupSpec(groups, ())]
        self.groups = groups
        self.block_size = groups[0].spec.block_size
        self.block_pool = BlockPool(num_blocks)
        self.managers: list[SingleTypeManager] = [
            manager_class(g.spec)(g.spec, self.block_pool, i) for i, g in enumerate(groups)]
        self.enable_caching = enable_caching
        self.stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block lists (a KV connector runs only with one group)."""
        return self.managers[0].req_to_blocks

    def empty(self) -> BlockLists:
        return tuple([] for _ in self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[BlockLists, int]:
        """The longest prefix cached in every group, as per-group blocks, and its token
        count. Capped at num_tokens - 1: the last token is always computed, so logits
        exist. A request that wants prompt logprobs computes its whole prompt (a hit has
        no logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty(), 0
        hashes = request.block_hashes
        length = min((request.num_tokens - 1) // self.block_size, len(hashes))
        while True:
            shorter = length
            for m in self.managers:
                shorter = min(shorter, len(m.find_hit(hashes, shorter)))
            if shorter == length:
                break
            length = shorter
        hits = tuple(m.find_hit(hashes, length) for m in self.managers)
        return hits, length * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits)."""
        if self.enable_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: BlockLists | None = None,
                       num_lookahead: int = 0,
                       num_external_tokens: int = 0) -> BlockLists | None:
        """Make room for `num_new_tokens` more tokens of `request` in every group, after
        taking the prefix-cache hits `computed` (only for a request that holds no blocks
        yet), plus `num_lookahead` slots beyond them that a draft model writes ahead
        (never cached). `num_external_tokens` (whole blocks, right after the hits) are
        loaded by a KV connector before this step's forward: they get new blocks, cached
        like computed ones (their KV is in place before any later step can read it).
        First, blocks a sliding window no longer reaches go back to the pool.

        Returns the newly allocated blocks per group (possibly none), or None when the
        pool cannot supply them; in that case nothing but those freed blocks changes."""
        computed = computed or self.empty()
        rid = request.request_id
        num_hits = len(computed[0])
        done = request.num_computed_tokens + num_hits * self.block_size + num_external_tokens
        for m in self.managers:
            m.remove_skipped_blocks(rid, request.num_computed_tokens)
        total = done + num_new_tokens + num_lookahead
        needed = [m.num_needed(rid, num_hits, total) for m in self.managers]
        # Hits that sit in the free queue stop being allocatable once touched.
        touched = sum(b.ref_cnt == 0 and not b.is_null for hits in computed for b in hits)
        if sum(needed) > self.block_pool.get_num_free_blocks() - touched:
            return None
        new = []
        for m, hits, n in zip(self.managers, computed, needed):
            self.block_pool.touch(hits)
            blocks = self.block_pool.get_new_blocks(n)
            m.append(rid, hits, blocks)
            if self.enable_caching:
                m.cache_full_blocks(rid, request.block_hashes, done + num_new_tokens)
            new.append(blocks)
        return tuple(new)

    def num_blocks_for(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, every group."""
        return sum(g.spec.max_blocks_held(num_tokens, max_chunk) for g in self.groups)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request.request_id)

    def uncache(self, request: Request) -> None:
        """Drop the prefix-cache entries of the blocks only `request` holds (its KV is not
        what their hashes claim); shared blocks were computed by others and stay."""
        for m in self.managers:
            mine = m.req_to_blocks.get(request.request_id, [])
            self.block_pool.uncache(b for b in mine if b.ref_cnt == 1)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, [])]
                     for m in self.managers)
