"""`kiln::fused_moe`: routing and the grouped expert GEMMs as one opaque op.

The compiled graph stays whole around it (its fake returns the output's shape); inside,
tokens are grouped by expert, so each expert's gate|up and down GEMMs run once over all
the tokens routed to it: on CUDA in one Triton kernel per GEMM (kiln.moe.triton_moe), on
a CPU as a loop over experts, each expert's GEMMs on kiln's packed bf16 kernel or on
PyTorch's (oneDNN) over the plain weights, as the tuning table chose per token count
(kiln.moe.cpu_plan). Routing follows transformers: softmax in float32, top-k, the
weights renormalized where the family does, cast to the activations' dtype; each expert's
output is scaled by its weight and summed per token.

Invariant: `w13_packed`/`w2_packed` are given together or not at all; with them, `w13`/`w2`
may be empty (released after packing) unless `dense_from` > 0 keeps them for the token
counts from `dense_from` on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, renormalize: bool,
              w13_packed: torch.Tensor | None = None, w2_packed: torch.Tensor | None = None,
              dense_from: int = 0) -> torch.Tensor:
    """x [T, H], router_logits [T, E], w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]
    -> [T, H]. The packed weights are kiln.ops.linear.pack's layout per expert."""
    weights, experts = route(router_logits, top_k, renormalize)
    if x.is_cuda and triton_moe_ready():
        from kiln.moe.triton_moe import fused_experts_triton

        return fused_experts_triton(x, weights.to(x.dtype), experts, w13, w2)
    packed = None
    if w13_packed is not None and w2_packed is not None \
            and (dense_from == 0 or x.shape[0] < dense_from):
        packed = (w13_packed, w2_packed)
    return grouped_experts(x, weights.to(x.dtype), experts, w13, w2, packed)


def triton_moe_ready() -> bool:
    """The Triton expert kernel (kiln.moe.triton_moe) serves CUDA tensors where Triton is
    installed; the grouped PyTorch loop serves the rest."""
    from kiln.ops.triton_runtime import triton_installed

    return triton_installed()


@fused_moe.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      top_k: int, renormalize: bool, w13_packed: torch.Tensor | None = None,
      w2_packed: torch.Tensor | None = None, dense_from: int = 0) -> torch.Tensor:
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
                    w13: torch.Tensor, w2: torch.Tensor,
                    packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert; one gate|up and one down GEMM per expert
    that got tokens (over `packed` (w13, w2) with kiln's kernel where given); scatter-add
    the weighted outputs back to their tokens."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    p13, p2 = packed if packed is not None else (None, None)
    num_experts = (w13 if p13 is None else p13).shape[0]  # w13 may be released
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    slot_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate_up = _project(x[rows], w13, p13, e)
        inter = gate_up.shape[1] // 2
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = _project(h, w2, p2, e) * slot_weights[start:start + n, None]
        out.index_add_(0, rows, y)
        start += n
    return out


def _project(a: torch.Tensor, w: torch.Tensor, wp: torch.Tensor | None,
             e: int) -> torch.Tensor:
    if wp is None:
        return F.linear(a, w[e])
    return torch.ops.kiln_cpu.linear_packed(a, wp[e], None, None, 0)
