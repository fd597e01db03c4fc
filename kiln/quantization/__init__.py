"""Quantized weights: one QuantizationConfig resolved at start-up, per-layer linear
methods (int8 made at load, GGUF blocks kept), and the packed formats the kernels read.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "apply_quantization": "apply", "resolve_quantization": "resolve",
})
