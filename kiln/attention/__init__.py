"""Attention: the opaque op, its layer, the forward context it reads, the backends and how
one is chosen.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "Attention": "layer", "AttentionBackend": "backend", "AttentionCGSupport": "backend",
    "AttentionLayerSpec": "backend", "AttentionMetadata": "backend",
    "BACKENDS": "selector", "preferred_attention_backend": "selector",
    "select_backend": "selector",
})
