"""BlockPool: every KV block, their reference counts, the free queue, and the prefix
cache (block hash -> block).

Invariants (property-tested): a block with `ref_cnt == 0` is in the free queue exactly
once; a block with `ref_cnt > 0` is not in it; block 0 is the null block, never handed
out and never freed (padding rows of the block table point at it). A free block may still
be cached: it keeps its hash until it is handed out again (evicted).

Free-queue order: freed blocks without a hash go to the head (reused first, LIFO); hashed
ones go to the tail, so allocation evicts the least recently freed cached block first.
Blocks never handed out sit between the two, in id order, and are created on first use:
a pool of 131,072 blocks (a tiny model's default) took 0.3 s to build at every start-up.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set by prefix caching when the block is full
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks with O(1) popleft, append and remove-from-middle
    (a cached block that gets hit again leaves the queue wherever it is).

    `fresh` ids are free blocks not yet linked (never handed out): one marker node stands
    for all of them, so `appendleft` lands before them and `append` after, and `popleft`
    takes the next fresh id through `make` when it reaches the marker. `make` must return
    one object per id (the pool's); a block leaves the fresh run only through popleft."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = (), fresh: range = range(0),
                 make: Callable[[int], KVCacheBlock] = KVCacheBlock) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._fresh = KVCacheBlock(-2)
        self._head.next_free, self._fresh.prev_free = self._fresh, self._head
        self._fresh.next_free, self._tail.prev_free = self._tail, self._fresh
        self._fresh_ids, self._make = fresh, make
        self.num_free_blocks = len(fresh)
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._fresh:
            if self._fresh_ids:
                block_id, self._fresh_ids = self._fresh_ids[0], self._fresh_ids[1:]
                self.num_free_blocks -= 1
                return self._make(block_id)
            block = block.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        first = self._head.next_free
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            if block is self._fresh:
                yield from map(self._make, self._fresh_ids)
            else:
                yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        self._blocks: list[KVCacheBlock | None] = [None] * num_blocks
        self.free_queue = FreeKVCacheBlockQueue(fresh=range(num_blocks), make=self._block)
        self.null_block = self.free_queue.popleft()
        self.null_block.is_null = True
        self.cached: dict[bytes, KVCacheBlock] = {}

    def _block(self, block_id: int) -> KVCacheBlock:
        block = self._blocks[block_id]
        if block is None:
            block = self._blocks[block_id] = KVCacheBlock(block_id)
        return block

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, those never handed out created now (for checks: the engine itself
        only ever holds the blocks it was given)."""
        return [self._block(i) for i in range(self.num_blocks)]

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) currently held."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"asked for {n} blocks, {self.get_num_free_blocks()} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    # ---- prefix cache --------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a free one leaves the free queue first. The
        null block (a sliding window's out-of-window hit) is never counted."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a newly full block. An equal block already cached keeps the entry
        (both hold the same KV; this one is simply not shareable)."""
        if block.block_hash is None:
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, block)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if not block.is_null:
                self._evict(block)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Blocks reaching zero join the queue: hashed
        ones at the tail in the given order (callers pass a request's tail blocks first, so
        those are evicted first), unhashed ones at the head."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
