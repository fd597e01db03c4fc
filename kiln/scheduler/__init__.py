from kiln.scheduler.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kiln.scheduler.block_hash import BlockHasher, hash_block
from kiln.scheduler.kv_cache_manager import KVCacheManager, PrefixCacheStats
from kiln.scheduler.kv_cache_spec import (FullAttentionSpec, KVCacheGroupSpec, KVCacheSpec,
                                         SlidingWindowSpec, group_layers)
from kiln.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.step import EngineCoreOutput, SchedulerPolicy, SchedulerStats

__all__ = ["BlockHasher", "PrefixCacheStats", "SchedulerPolicy", "SchedulerStats",
           "hash_block", "BlockPool", "CachedRequestData", "EngineCoreOutput", "FreeKVCacheBlockQueue",
           "FullAttentionSpec", "KVCacheBlock", "KVCacheGroupSpec", "KVCacheManager", "KVCacheSpec",
           "SlidingWindowSpec", "group_layers",
           "ModelRunnerOutput", "NewRequestData", "Scheduler", "SchedulerOutput"]
