"""Mixture-of-experts blocks and the fused-experts op."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "fused_moe": "op", "FusedExperts": "layer", "SparseMoeBlock": "layer",
})
