"""Quantized weights: one QuantizationConfig resolved at start-up, per-layer linear
methods (int8 made at load, GGUF blocks kept), and the packed formats the kernels read."""
from kiln.quantization.config import (CHOICES, GGUF_NATIVE, QuantizationConfig,
                                      resolve_quantization)

__all__ = ["CHOICES", "GGUF_NATIVE", "QuantizationConfig", "resolve_quantization"]
