"""Which kernel the experts' GEMMs run on a CPU, at which token counts: the tuning table
decides, as for the dense linears (kiln/ops/linear_plan.py).

`kiln bench kernels --ops fused_moe` times the whole op per MoE shape and token count
with two expert-GEMM candidates (kiln/bench/cases_moe.py): `F.linear` (PyTorch's GEMM,
oneDNN, on the stacked plain weights) and `kiln-packed` (kiln's packed bf16 kernel on
each expert's weights packed once at load). At start-up `pack_experts` gives every bf16
`FusedExperts` a `LinearPlan` from those times: packed or not, and the token count from
which the plain weights (then kept beside the packed ones) take over. Without table
entries the experts are packed at every token count, the dense linears' default.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from kiln.ops.linear import pack, packable, param_owners
from kiln.ops.linear_plan import DEFAULT, LinearPlan, plan_from_times

MoEShape = tuple[int, int, int, int]  # (experts, top_k, hidden, intermediate per expert)


def moe_key(tokens: int, shape: MoEShape, dtype: torch.dtype) -> str:
    from kiln.ops.tuning import shape_key

    e, k, h, i = shape
    return shape_key(tokens=tokens, experts=e, top_k=k, hidden=h, inter=i, dtype=dtype)


def plans_from_table(entries: Mapping[str, Any], dtype: torch.dtype
                     ) -> dict[MoEShape, LinearPlan]:
    """{shape: plan} from a device's "fused_moe" tuning entries for `dtype`."""
    from kiln.ops.tuning import times_by_shape

    def shape_of(d: dict[str, str]) -> MoEShape:
        return int(d["experts"]), int(d["top_k"]), int(d["hidden"]), int(d["inter"])

    times = times_by_shape(entries, dtype, shape_of, "tokens")
    return {shape: plan_from_times(t) for shape, t in times.items()}


def load_moe_plans(dtype: torch.dtype, device: torch.device) -> dict[MoEShape, LinearPlan]:
    from kiln.ops.tuning import device_entries

    return plans_from_table(device_entries("fused_moe", device), dtype)


def pack_expert_weights(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, N/16, K/32, 16, 32]: kiln.ops.linear.pack per expert."""
    return torch.stack([pack(w[e]) for e in range(w.shape[0])])


def pack_experts(model: nn.Module, plans: Mapping[MoEShape, LinearPlan] | None = None
                 ) -> list[str]:
    """Pack every eligible block's experts in place as `plans` say; returns what each
    packed block runs ("<shape>: <plan>"), for the start-up log."""
    from kiln.moe.layer import SparseMoeBlock

    owners, done = param_owners(model), []
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        ex = block.experts
        shape = (ex.w13.shape[0], block.top_k, ex.w13.shape[2], ex.inter)
        plan = (plans or {}).get(shape, DEFAULT)
        if not (plan.pack and packable(ex.w13[0]) and packable(ex.w2[0])):
            continue
        ex.w13_packed = pack_expert_weights(ex.w13.detach())
        ex.w2_packed = pack_expert_weights(ex.w2.detach())
        ex.dense_from = plan.dense_from
        for p in (ex.w13, ex.w2):
            if owners[id(p)] == 1 and not plan.dense_from:  # nobody reads it: free it
                p.data = p.data.new_empty(0)
        done.append(f"experts {shape}: {plan.describe()}")
    return done


def moe_plan_signature(model: nn.Module) -> list[tuple[str, int]]:
    """(block name, dense_from) of every packed block, for the compile-cache key: the
    graph passes the packed weights and `dense_from` (a constant) only there."""
    from kiln.moe.layer import FusedExperts

    return [(name, m.dense_from) for name, m in model.named_modules()
            if isinstance(m, FusedExperts) and m.w13_packed is not None]
