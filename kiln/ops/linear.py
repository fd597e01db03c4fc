"""Linear layers over kiln's prepacked bf16 weights (see csrc/linear_bf16.cpp).

`pack_linears(model)` runs once after loading: every `kiln.models.layers.Linear` whose
weight is bf16 on the CPU, with N % 16 == 0 and K % 32 == 0, gets `packed_weight` (the
tile layout the kernel streams), and its unpacked weight is released unless another
module shares it (a tied lm_head keeps the embedding). Everything else stays on F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.ops import cpu_kernels


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
           packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = torch.ops.kiln_cpu.linear_packed(x.reshape(-1, x.shape[-1]), packed, bias)
    return out.view(*lead, out.shape[-1])


def pack_linears(model: nn.Module) -> int:
    """Pack every eligible kiln Linear in place; returns how many were packed."""
    from kiln.models.layers import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    count = 0
    for m in linears:
        if not packable(m.weight):
            continue
        m.packed_weight = pack(m.weight.detach())
        if owners[id(m.weight)] == 1:  # nobody else reads it: free the unpacked copy
            m.weight.data = m.weight.data.new_empty(0)
        count += 1
    return count


def register_fakes() -> None:
    """Shape functions for tracing; called once the library defining the ops is loaded."""

    @torch.library.register_fake("kiln_cpu::linear_packed")
    def _linear_packed_fake(x: torch.Tensor, wp: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 16))
