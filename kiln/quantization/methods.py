"""The quantized linear method a `kiln.models.layers.Linear` computes its GEMM with.

Every Linear delegates `forward` to its `quant_method`, so model files never change:
- `UNQUANTIZED` (kiln.models.layers, each layer's default): the float weight (kiln's
  packed bf16 kernel or F.linear, as planned);
- `QuantizedLinearMethod`: a `QuantWeight` (kiln.ops.quant_packing) installed as the
  layer's buffers `qcodes`, `qscales`, `qmins`, run by the `kiln_cpu::linear_quant`
  custom op (fake-registered: the compiled graph calls it like any op).
`panel_from` (the row count from which the kernel's panel path runs) is a per-layer
Python int fixed at trace time; the linear-plan signature puts it in the cache key.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.models.layers import LinearMethod
from kiln.ops.linear import linear_quant, linear_quant_silu
from kiln.ops.quant_packing import FORMAT_NAMES, QuantWeight


class QuantizedLinearMethod(LinearMethod):
    """The GEMM over the layer's quantized buffers, dequantized inside the kernel."""

    quantized = True

    def __init__(self, name: str) -> None:
        self.name = name  # the quantization method that made the weight ("int8", "gguf")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        return linear_quant(x, layer.qcodes, layer.qscales, layer.qmins, bias, layer.qfmt,
                            layer.panel_from, layer.kept_rows)

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear_quant_silu(x, layer.qcodes, layer.qscales, layer.qmins, layer.qfmt,
                                 layer.panel_from, layer.kept_rows)


def install(layer: nn.Module, weight: QuantWeight, method: QuantizedLinearMethod,
            release_float: bool) -> None:
    """Make `layer` run on `weight`; drop its float weight unless another module shares
    it (a tied lm_head leaves the embedding its table)."""
    if weight.shape != tuple(layer.weight.shape) and layer.weight.numel():
        raise ValueError(f"quantized weight {weight.shape} does not match the layer's "
                         f"{tuple(layer.weight.shape)}")
    layer.qcodes, layer.qscales, layer.qmins = weight.codes, weight.scales, weight.mins
    layer.qfmt = weight.fmt
    layer.quant_method = method
    layer.packed_weight = None
    if release_float:
        layer.weight.data = layer.weight.data.new_empty(0)


def format_name(layer: nn.Module) -> str:
    return FORMAT_NAMES[layer.qfmt] if layer.quant_method.quantized else "float"
