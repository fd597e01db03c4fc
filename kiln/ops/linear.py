"""Linear layers over kiln's prepacked bf16 weights (see csrc/linear_bf16.cpp).

`pack_linears(model, plans)` runs once after loading: every `kiln.models.layers.Linear`
whose weight is bf16 on the CPU, with N % 16 == 0 and K % 32 == 0, and whose plan
(linear_plan.py: the tuning table's winners, else packed everywhere) says so, gets
`packed_weight` (the tile layout the kernel streams). Its unpacked weight is released
unless another module shares it (a tied lm_head keeps the embedding) or the plan runs
F.linear from some row count on (`dense_from`). Everything else stays on F.linear.
"""
from __future__ import annotations

import hashlib
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from kiln.ops import cpu_kernels
from kiln.ops.linear_plan import DEFAULT, LinearPlan
from kiln.quantization.packing import FP8, QuantWeight, dequantize


def packable(weight: torch.Tensor) -> bool:
    return (cpu_kernels.loaded() and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: out[nb, kc, r, 2n + i] = w[16nb + n, 32kc + 2r + i]."""
    n, k = weight.shape
    return (weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
            .reshape(n // 16, k // 32, 16, 32).contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, dense_from: int = 0) -> torch.Tensor:
    """x @ weight.T + bias; over `packed` when the layer has it, with F.linear on the
    plain `weight` (kept for the purpose) from `dense_from` rows on when that is set."""
    if packed is None:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_packed(x.reshape(-1, x.shape[-1]), packed, bias,
                                           weight if dense_from else None, dense_from)
    return out.view(*lead, out.shape[-1])


def linear_quant(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None, fmt: int,
                 panel_from: int = 0) -> torch.Tensor:
    """x @ dequant(w).T + bias over a quantized weight (kiln.quantization.packing):
    kiln's CPU kernel where it is loaded, the Triton dequant-GEMM on CUDA; elsewhere the
    exact reference (the weight dequantized per call: slower, same numbers)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if cpu_kernels.loaded() and x.device.type == "cpu" and fmt != FP8:  # FP8: CUDA only
        out = torch.ops.kiln_cpu.linear_quant(x2, codes, scales, mins, bias, fmt, panel_from)
    elif x.device.type == "cuda":
        from kiln.ops.triton_quant import linear_quant_cuda

        out = linear_quant_cuda(x2, codes, scales, mins, bias, fmt)
    else:
        w = dequantize(QuantWeight(fmt, codes, scales, mins), x.dtype)
        out = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
    return out.view(*lead, out.shape[-1])


def param_owners(model: nn.Module) -> Counter[int]:
    """How many modules hold each parameter (by id): a weight held once may be freed once
    its layer no longer reads it; a tied one (lm_head = embedding) may not."""
    return Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))


def pack_linears(model: nn.Module,
                 plans: dict[tuple[int, int], LinearPlan] | None = None) -> int:
    """Pack every eligible kiln Linear in place, as `plans` ({(n, k): plan}, default:
    packed at every row count) say; returns how many were packed."""
    from kiln.models.layers import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    owners = param_owners(model)
    count = 0
    for m in linears:
        if m.quant_method.quantized:
            continue
        plan = (plans or {}).get(tuple(m.weight.shape), DEFAULT)
        if not (plan.pack and packable(m.weight)):
            continue
        m.packed_weight = pack(m.weight.detach())
        m.dense_from = plan.dense_from
        if owners[id(m.weight)] == 1 and not plan.dense_from:  # nobody reads it: free it
            m.weight.data = m.weight.data.new_empty(0)
        count += 1
    return count


def plan_signature(model: nn.Module) -> str | None:
    """What the packing and quantization decided, per layer, for the compile-cache key:
    the compiled graph calls the packed kernel (and passes `dense_from`) only where a
    layer (or a block's experts) is packed, and the quantized kernel with its format and
    panel row count."""
    from kiln.models.layers import Linear

    layers = [(name, m.dense_from) for name, m in model.named_modules()
              if isinstance(m, Linear) and m.packed_weight is not None]
    # Quantized layers: their format and panel row count are constants in the graph.
    layers += [(name, m.qfmt, m.panel_from) for name, m in model.named_modules()
               if isinstance(m, Linear) and m.quant_method.quantized]
    from kiln.moe.cpu_plan import moe_plan_signature  # late: kiln.moe imports this module

    layers += moe_plan_signature(model)
    return hashlib.sha256(repr(layers).encode()).hexdigest()[:16] if layers else None


def register_fakes() -> None:
    """Shape functions for tracing; called once the library defining the ops is loaded."""

    @torch.library.register_fake("kiln_cpu::linear_packed")
    def _linear_packed_fake(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None,
                            dense: torch.Tensor | None = None,
                            dense_from: int = 0) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::linear_quant")
    def _linear_quant_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None, bias: torch.Tensor | None, fmt: int,
                           panel_from: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::lora_add_")
    def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, scaling: torch.Tensor,
                       indices: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::apply_token_bitmask_")
    def _apply_token_bitmask_fake(logits: torch.Tensor, rows: torch.Tensor,
                                  bitmask: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::greedy_argmax")
    def _greedy_argmax_fake(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((logits.shape[0],), dtype=torch.long)
