from kiln.scheduler.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kiln.scheduler.kv_cache_manager import KVCacheManager
from kiln.scheduler.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from kiln.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)
from kiln.scheduler.scheduler import EngineCoreOutput, Scheduler

__all__ = ["BlockPool", "CachedRequestData", "EngineCoreOutput", "FreeKVCacheBlockQueue",
           "FullAttentionSpec", "KVCacheBlock", "KVCacheManager", "KVCacheSpec",
           "ModelRunnerOutput", "NewRequestData", "Scheduler", "SchedulerOutput"]
