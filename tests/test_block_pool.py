"""BlockPool and free-queue invariants."""
from __future__ import annotations

import pytest

from kiln.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_null_block_is_reserved():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert 0 not in [b.block_id for b in blocks]
    pool.free_blocks([pool.null_block])  # ignored, never enters the queue
    assert pool.get_num_free_blocks() == 0


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        queue.append(blocks[3])  # already queued


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert a.ref_cnt == b.ref_cnt == 1
    b.ref_cnt += 1  # a second holder (shared prefix)
    pool.free_blocks([a, b])
    assert a.ref_cnt == 0 and b.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])


def test_unhashed_blocks_are_reused_first_hashed_ones_evicted_lru():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(7)
    for b in blocks[:3]:
        pool.cache_block(b, bytes([b.block_id]))
    pool.free_blocks(reversed(blocks))  # a request frees its tail first
    # Unhashed 7, 6, 5, 4 went to the head (LIFO); hashed 3, 2, 1 to the tail in that order.
    assert [blk.block_id for blk in pool.free_queue] == [4, 5, 6, 7, 3, 2, 1]
    again = pool.get_new_blocks(5)  # takes 4..7, then evicts the oldest cached: 3
    assert [b.block_id for b in again] == [4, 5, 6, 7, 3]
    assert pool.get_cached_block(bytes([3])) is None and blocks[2].block_hash is None
    assert pool.get_cached_block(bytes([1])) is blocks[0]


def test_touch_takes_cached_blocks_off_the_free_queue():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a")
    pool.free_blocks([a, b])
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(b"a")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert hit not in list(pool.free_queue)
    pool.touch([hit])  # a second holder: no queue change
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 2


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    assert pool.usage == 0.0


def test_blocks_never_handed_out_are_created_on_first_use_in_id_order():
    """A pool starts with only its null block as an object; the rest are created as they
    are handed out, between the freed unhashed blocks (head) and the cached ones (tail)."""
    pool = BlockPool(1 << 20)
    assert sum(b is not None for b in pool._blocks) == 1  # the null block
    a, b, c = pool.get_new_blocks(3)
    assert [a.block_id, b.block_id, c.block_id] == [1, 2, 3]
    pool.cache_block(c, b"c")
    pool.free_blocks([a, c])  # a (unhashed) to the head, c (cached) to the tail
    assert pool.get_num_free_blocks() == (1 << 20) - 2
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 4, 5]
    small = BlockPool(6)
    x, y = small.get_new_blocks(2)
    small.cache_block(y, b"y")
    small.free_blocks([x, y])
    assert [blk.block_id for blk in small.free_queue] == [1, 3, 4, 5, 2]
    listed = small.blocks  # creates the untouched ones now
    assert small.get_new_blocks(2)[1] is listed[3]  # one object per id
