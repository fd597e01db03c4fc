"""Triton kernels behind the `triton` attention backend.

The public names load on first access (PEP 562), so `import kiln` never imports Triton
(0.3 s, and absent on some machines); only a selected Triton backend or a harness does.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "default_config": "attention_kernel", "KVWriteConfig": "kv_write",
    "sweep_space": "attention_kernel", "unified_attention": "attention_kernel",
    "UnifiedAttentionConfig": "attention_kernel", "write_kv": "kv_write",
})
