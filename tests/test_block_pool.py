"""BlockPool and free-queue invariants."""
from __future__ import annotations

import pytest

from kiln.scheduler import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


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


def test_freed_blocks_join_the_tail_in_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(reversed(blocks))
    assert [blk.block_id for blk in pool.free_queue] == [5, 4, 3, 2, 1]


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    assert pool.usage == 0.0
