"""`kiln::fused_moe`: routing and the grouped expert GEMMs as one opaque op.

The compiled graph stays whole around it (its fake returns the output's shape); inside,
tokens are grouped by expert, so each expert's gate|up and down GEMMs run once over all
the tokens routed to it: on CUDA in one Triton kernel per GEMM (kiln.moe.triton_moe), on
a CPU as a loop over experts. Routing follows transformers: softmax in float32, top-k, the
weights renormalized where the family does, cast to the activations' dtype; each expert's
output is scaled by its weight and summed per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """x [T, H], router_logits [T, E], w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]
    -> [T, H]."""
    weights, experts = route(router_logits, top_k, renormalize)
    if x.is_cuda and triton_moe_ready():
        from kiln.moe.triton_moe import fused_experts_triton

        return fused_experts_triton(x, weights.to(x.dtype), experts, w13, w2)
    return grouped_experts(x, weights.to(x.dtype), experts, w13, w2)


def triton_moe_ready() -> bool:
    """The Triton expert kernel (kiln.moe.triton_moe) serves CUDA tensors where Triton is
    installed; the grouped PyTorch loop serves the rest."""
    from kiln.attention.kernels.triton_runtime import triton_installed

    return triton_installed()


@fused_moe.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      top_k: int, renormalize: bool) -> torch.Tensor:
    return torch.empty_like(x)


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k expert weights (float32) and ids, [T, k] each."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert; one gate|up and one down GEMM per expert
    that got tokens; scatter-add the weighted outputs back to their tokens."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // k
    slot_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate_up = F.linear(x[rows], w13[e])
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * slot_weights[start:start + n, None]
        out.index_add_(0, rows, y)
        start += n
    return out
