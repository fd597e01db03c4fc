"""Linear kernels: over kiln's prepacked bf16 weights (see csrc/linear_bf16.cpp), over
quantized weights (quant_packing.py), and plain F.linear.

`packable`/`pack` make the tile layout the packed kernel streams; which layers get it is
decided by `kiln.models.packing.pack_linears` (the model walk lives with the models).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from kiln.ops import cpu_kernels
from kiln.ops.pointwise import kernel_applies, silu_and_mul
from kiln.ops.quant_packing import FP8, QuantWeight, dequantize


def packable(weight: torch.Tensor) -> bool:
    return (cpu_kernels.planned() and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: out[nb, kc, r, 2n + i] = w[16nb + n, 32kc + 2r + i]."""
    n, k = weight.shape
    return (weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
            .reshape(n // 16, k // 32, 16, 32).contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, dense_from: int = 0,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; over `packed` when the layer has it, with F.linear on the
    plain `weight` (kept for the purpose) from `dense_from` rows on when that is set.
    `rows`: the kept-rows hint of kiln's CPU kernels (csrc/kept_rows.h), which may then
    return zeros in the rows it does not name; other paths compute every row."""
    if packed is None:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_packed(x.reshape(-1, x.shape[-1]), packed, bias,
                                           weight if dense_from else None, dense_from, rows)
    return out.view(*lead, out.shape[-1])


def linear_silu(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
                dense_from: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u of x @ [gate | up].T over the packed weight, the activation in the
    GEMM's epilogue on tiles and AVX512 register tiles (csrc/linear_bf16.cpp): the same
    bits as `linear` followed by kiln.ops.pointwise.silu_and_mul."""
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_packed_silu(x.reshape(-1, x.shape[-1]), packed,
                                                weight if dense_from else None, dense_from,
                                                rows)
    return out.view(*lead, out.shape[-1])


def linear_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: torch.Tensor, dense_from: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, rope_cols: int) -> torch.Tensor:
    """`linear` over the packed weight with Neox RoPE on the first rope_cols columns
    (q's then k's heads of cos.shape[1], from the float32 caches), in the GEMM's epilogue
    where tiles run (csrc/linear_bf16_amx.h): the same bits as `linear` followed by
    kiln.ops.pointwise.rotary_neox."""
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_packed_rope(x.reshape(-1, x.shape[-1]), packed, bias,
                                                positions, cos, sin, rope_cols,
                                                weight if dense_from else None, dense_from)
    return out.view(*lead, out.shape[-1])


def linear_quant(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None, fmt: int,
                 panel_from: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(w).T + bias over a quantized weight (kiln.ops.quant_packing):
    kiln's CPU kernel where it is loaded, the Triton dequant-GEMM on CUDA; elsewhere the
    exact reference (the weight dequantized per call: slower, same numbers)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if cpu_kernels.planned() and x.device.type == "cpu" and fmt != FP8:  # FP8: CUDA only
        out = torch.ops.kiln_cpu.linear_quant(x2, codes, scales, mins, bias, fmt, panel_from,
                                              rows)
    elif x.device.type == "cuda":
        from kiln.ops.triton_quant import linear_quant_cuda

        out = linear_quant_cuda(x2, codes, scales, mins, bias, fmt)
    else:
        w = dequantize(QuantWeight(fmt, codes, scales, mins), x.dtype)
        out = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
    return out.view(*lead, out.shape[-1])


def linear_quant_silu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None, fmt: int, panel_from: int = 0,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u of x @ dequant([gate | up]).T: the activation in the native-bf16
    panel's epilogue where it runs (csrc/linear_quant_bf16.cpp), the same bits as
    `linear_quant` followed by kiln.ops.pointwise.silu_and_mul everywhere."""
    if not (kernel_applies(x) and fmt != FP8 and codes.shape[0] % 2 == 0):
        return silu_and_mul(linear_quant(x, codes, scales, mins, None, fmt, panel_from,
                                         rows))
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_quant_silu(x.reshape(-1, x.shape[-1]), codes, scales,
                                               mins, fmt, panel_from, rows)
    return out.view(*lead, out.shape[-1])


def param_owners(model: nn.Module) -> Counter[int]:
    """How many modules hold each parameter (by id): a weight held once may be freed once
    its layer no longer reads it; a tied one (lm_head = embedding) may not."""
    return Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
