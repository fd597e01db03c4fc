"""`linear(x, w, b)`: F.linear, or kiln's streaming bf16 kernel where it is faster.

The choice is made while tracing, from dtype and device only, so one compiled graph
serves every token count; the kernel itself hands row counts above its limit to
`at::linear` at run time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import cpu_kernels


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and x.device.type == "cpu" and cpu_kernels.loaded()):
        return torch.ops.kiln_cpu.linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)



def register_fakes() -> None:
    """Shape functions for tracing; called once the library defining the ops is loaded."""

    @torch.library.register_fake("kiln_cpu::linear_bf16")
    def _linear_bf16_fake(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))
