"""KVCacheManager: the ledger of which blocks each request holds."""
from __future__ import annotations

from kiln.engine.request import Request
from kiln.scheduler.block_pool import BlockPool, KVCacheBlock
from kiln.scheduler.kv_cache_spec import KVCacheSpec


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Returns the newly allocated blocks (possibly none), or None when the pool cannot
        supply them; in that case nothing changes.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(blocks)
        if needed > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        new_blocks = self.block_pool.get_new_blocks(max(needed, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first (tails are the least reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
