"""Lay a loaded model's weights out for kiln's CPU kernels, and name what was decided.

`pack_linears(model, plans)` runs once after loading: every `kiln.models.layers.Linear`
whose weight is bf16 on the CPU, with N % 16 == 0 and K % 32 == 0, and whose plan
(kiln.ops.linear_plan: the tuning table's winners, else packed everywhere) says so, gets
`packed_weight` (the tile layout the kernel streams). Its unpacked weight is released
unless another module shares it (a tied lm_head keeps the embedding) or the plan runs
F.linear from some row count on (`dense_from`). Everything else stays on F.linear.
`plan_signature` names those decisions for the compile-cache key.
"""
from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from kiln.models.layers import Linear
from kiln.models.model_config import ModelConfig
from kiln.moe.cpu_plan import load_moe_plans, moe_plan_signature, pack_experts
from kiln.ops.linear import pack, packable, param_owners
from kiln.ops.linear_plan import DEFAULT, LinearPlan, load_plans

logger = logging.getLogger(__name__)


def pack_linears(model: nn.Module,
                 plans: dict[tuple[int, int], LinearPlan] | None = None) -> int:
    """Pack every eligible kiln Linear in place, as `plans` ({(n, k): plan}, default:
    packed at every row count) say; returns how many were packed."""
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
    layers = [(name, m.dense_from) for name, m in model.named_modules()
              if isinstance(m, Linear) and m.packed_weight is not None]
    # Quantized layers: their format and panel row count are constants in the graph.
    layers += [(name, m.qfmt, m.panel_from) for name, m in model.named_modules()
               if isinstance(m, Linear) and m.quant_method.quantized]
    layers += moe_plan_signature(model)
    return hashlib.sha256(repr(layers).encode()).hexdigest()[:16] if layers else None


def pack_cpu_weights(model: nn.Module, model_config: ModelConfig, dtype: torch.dtype,
                     device: torch.device) -> None:
    """Lay bf16 weights out for kiln's CPU kernels as the tuning table's plans say (before
    tracing: the graph calls the packed kernels only where a layer is packed)."""
    plans = load_plans(dtype, device)
    logger.info("packed %d bf16 linear weights for kiln's CPU kernels (%s)",
                pack_linears(model, plans),
                "; ".join(f"{n}x{k}: {p.describe()}" for (n, k), p in plans.items())
                or "no tuning table entries: packed at every row count")
    if model_config.moe is not None:
        moe_plans = load_moe_plans(dtype, device)
        logger.info("experts for kiln's CPU kernels: %s%s",
                    "; ".join(pack_experts(model, moe_plans)) or "none packed",
                    "" if moe_plans else " (no tuning table entries: the default)")
