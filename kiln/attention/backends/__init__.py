"""Attention backends, independent of one another: torch (SDPA), cpu (kiln's kernels),
triton.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "TorchPagedBackend": "torch_paged", "TritonPagedBackend": "triton_paged",
})
