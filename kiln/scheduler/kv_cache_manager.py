"""KVCacheManager: the ledger of which blocks each request holds, and prefix-cache hits."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.engine.request import Request
from kiln.scheduler.block_pool import BlockPool, KVCacheBlock
from kiln.scheduler.kv_cache_spec import KVCacheSpec


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, num_blocks: int,
                 enable_caching: bool = False) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}  # blocks of each request already registered
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, in blocks, and its token count. Capped
        at num_tokens - 1: the last token is always computed, so logits exist. A request
        that wants prompt logprobs computes its whole prompt (a hit has no logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry while it waits)."""
        if self.enable_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[KVCacheBlock] | None = None,
                       num_lookahead: int = 0,
                       num_external_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`, after taking the
        prefix-cache hits `computed` (only for a request that holds no blocks yet), plus
        `num_lookahead` slots beyond them that a draft model writes ahead (never cached).
        `num_external_tokens` (whole blocks, right after the hits) are loaded by a KV
        connector before this step's forward: they get new blocks, cached like computed
        ones (their KV is in place before any later step can read it through a hit).

        Returns the newly allocated blocks (possibly none), or None when the pool cannot
        supply them; in that case nothing changes."""
        computed = computed or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        done = request.num_computed_tokens + len(computed) * self.block_size \
            + num_external_tokens
        needed = -(-(done + num_new_tokens + num_lookahead) // self.block_size) \
            - len(blocks) - len(computed)
        # Hits that sit in the free queue stop being allocatable once touched.
        free = self.block_pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in computed)
        if needed > free:
            return None
        self.block_pool.touch(computed)
        new_blocks = self.block_pool.get_new_blocks(max(needed, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, done + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Register the blocks this step fills (their KV is written in this step's
        forward, before any later step can read it through a hit)."""
        full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached.get(request.request_id, 0)
        for i in range(start, full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(start, full)

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first (tails are the least reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
