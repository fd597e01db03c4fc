"""`kiln bench kernels --ops fused_moe`: the whole `kiln::fused_moe` op (routing and the
grouped expert GEMMs) per MoE shape and token count, with each expert-GEMM candidate.

  F.linear     PyTorch's GEMM (oneDNN) on the stacked plain weights (the reference)
  kiln-packed  kiln's packed bf16 kernel on each expert's weights, packed once beforehand
               (bf16 on a CPU where kiln's kernels are loaded)
  triton       the Triton fused-MoE kernel (CUDA, where Triton is installed)

The shape is the model's (experts, top-k, hidden, intermediate per expert); for a dense
model it is `kiln bench moe`'s random Mixtral (8 experts, top-2, 512 -> 1024), so the
harness always has MoE shapes to time. The engine reads the CPU winners back per shape
(kiln/moe/cpu_plan.py): whether the experts are packed and from which token count the
plain weights run.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.bench.cases import Candidate, Case, Shapes, close
from kiln.moe.cpu_plan import moe_key, pack_expert_weights
from kiln.moe.op import fused_moe, grouped_experts, route, triton_moe_ready
from kiln.ops import cpu_kernels

DEFAULT_SHAPE = (8, 2, 512, 1024)  # kiln bench moe's Mixtral: experts, top_k, hidden, inter


def moe_shape(s: Shapes) -> tuple[int, int, int, int]:
    if s.moe is None:
        return DEFAULT_SHAPE
    e, k, inter = s.moe
    return e, k, s.hidden, inter


def fused_moe_cases(s: Shapes, compiled: bool) -> list[Case]:
    del compiled  # the op is opaque to the compiler: nothing to compile
    shape = moe_shape(s)
    e, k, h, inter = shape
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5).to(s.device, s.dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).to(s.device, s.dtype)
    packed = None
    if s.device.type == "cpu" and s.dtype == torch.bfloat16 and cpu_kernels.loaded() \
            and h % 32 == 0 and inter % 32 == 0:
        packed = (pack_expert_weights(w13), pack_expert_weights(w2))
    cases = []
    for t in s.token_counts:
        x = torch.randn(t, h, generator=g).to(s.device, s.dtype)
        logits = torch.randn(t, e, generator=g).to(s.device, s.dtype)
        cands = [Candidate("F.linear", _loop(x, logits, w13, w2, k))]
        if packed is not None:
            cands.append(Candidate("kiln-packed", lambda x=x, lg=logits: fused_moe(
                x, lg, w13, w2, k, True, packed[0], packed[1], 0)))
        if s.device.type == "cuda" and triton_moe_ready():
            cands.append(Candidate("triton", lambda x=x, lg=logits: fused_moe(
                x, lg, w13, w2, k, True)))
        tol = 1e-4 if s.dtype == torch.float32 else 2e-2
        cases.append(Case("fused_moe", moe_key(t, shape, s.dtype), cands,
                          compare=lambda a, b, tol=tol: close(a, b, tol)))
    return cases


def _loop(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
          k: int) -> Callable[[], Any]:
    """The op's CPU path on the plain weights, called directly so that on CUDA too it is
    the grouped loop (the op itself would take the Triton kernel there)."""
    def run() -> torch.Tensor:
        weights, experts = route(logits, k, True)
        return grouped_experts(x, weights.to(x.dtype), experts, w13, w2)

    return run
