"""SparseMoeBlock: a router, the experts stacked at load (gate|up and down), and for
Qwen2-MoE a shared expert behind a sigmoid gate. The block calls `kiln::fused_moe`.

Checkpoints store one tensor per expert and projection; `expert_checkpoint_name` maps
them onto the stacked parameters with a shard id `"<expert>:<gate|up|down>"` that
`FusedExperts.weight_loader` copies into place.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from kiln.moe.config import MoEConfig
from kiln.moe.op import fused_moe

# Mixtral names its projections w1 (gate), w3 (up), w2 (down); Qwen names them.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down"}


def expert_checkpoint_name(name: str) -> tuple[str, str] | None:
    """(stacked parameter name, shard id) for one expert's tensor; None otherwise."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _EXPERT.search(name)
    if m is None:
        return None
    role = _ROLE[m.group(2)]
    param = "w2" if role == "down" else "w13"
    return f"{name[:m.start()]}.experts.{param}", f"{m.group(1)}:{role}"


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        # Set by kiln.moe.cpu_plan.pack_experts on bf16 CPU weights: each expert's
        # weights in kiln's packed tile layout, and the token count from which the plain
        # weights (then kept) run instead.
        self.register_buffer("w13_packed", None, persistent=False)
        self.register_buffer("w2_packed", None, persistent=False)
        self.dense_from = 0

    def weight_loader(self, param: nn.Parameter, weight, shard: str | None) -> None:
        expert, role = shard.split(":")
        e = int(expert)
        dest = {"gate": param.data[e, : self.inter], "up": param.data[e, self.inter:],
                "down": param.data[e]}[role]
        src = weight.full()
        if src.shape != dest.shape:
            raise ValueError(f"expert {e} {role} weight has shape {tuple(src.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(src)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig, shared_mlp: nn.Module | None) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)  # the router
        self.experts = FusedExperts(moe.num_experts, hidden, moe.intermediate_size)
        self.shared_expert = shared_mlp
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        out = fused_moe(x, self.gate(x), ex.w13, ex.w2, self.top_k, self.renormalize,
                        ex.w13_packed, ex.w2_packed, ex.dense_from)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
