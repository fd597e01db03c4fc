"""The paged KV cache's bookkeeping: block pool, block hashes for prefix caching, the
KV-cache specs (full attention, sliding window) and the manager over their groups.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "BlockHasher": "block_hash", "BlockPool": "block_pool",
    "FreeKVCacheBlockQueue": "block_pool", "FullAttentionSpec": "kv_cache_spec",
    "group_layers": "kv_cache_spec", "hash_block": "block_hash",
    "KVCacheBlock": "block_pool", "KVCacheGroupSpec": "kv_cache_spec",
    "KVCacheManager": "kv_cache_manager", "KVCacheSpec": "kv_cache_spec",
    "PrefixCacheStats": "kv_cache_manager", "SlidingWindowSpec": "kv_cache_spec",
})
