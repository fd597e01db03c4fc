"""Give a model's linears LoRA slots, and write adapters into them.

`install_slots` runs once, before compiling: every kiln `Linear` inside the decoder
layers gets zeroed slot buffers (kiln.ops.lora has the layout) and shares one
`lora_indices` tensor, all registered as buffers so the traced graph takes them as inputs.
Afterwards only their contents change (`write_slot`, `clear_slot`), never their identity:
the compiled graph and any captured CUDA graph keep reading the same addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.config.lora import LoRAConfig
from kiln.distributed.parallel_state import tp_rank
from kiln.models.layers import Linear
from kiln.models.linear import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True, slots=True)
class ModuleUpdate:
    """One adapter's A and B for one checkpoint projection (e.g. layer 3's k_proj), as
    the checkpoint holds them (unscaled, full shapes), and its scaling."""

    a: torch.Tensor  # [r, in] (the checkpoint's full input width)
    b: torch.Tensor  # [out, r] (the checkpoint's full output rows)
    scaling: float


def lora_targets(model: nn.Module) -> dict[str, Linear]:
    """The LoRA-able linears by module path: every kiln Linear in the decoder layers."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, Linear) and ".layers." in f".{name}"}


def shard_names(layer: Linear) -> list[str | None]:
    return list(layer.shards) if isinstance(layer, ColumnParallelLinear) else [None]


def install_slots(model: nn.Module, cfg: LoRAConfig, indices: torch.Tensor,
                  dtype: torch.dtype) -> dict[str, Linear]:
    targets = lora_targets(model)
    S, R = cfg.max_loras, cfg.max_lora_rank
    for layer in targets.values():
        nr = len(shard_names(layer)) * R
        device = indices.device
        layer.lora_a = torch.zeros(S * nr, layer.in_features, dtype=dtype, device=device)
        layer.lora_b = torch.zeros(S * nr, layer.out_features, dtype=dtype, device=device)
        layer.lora_scaling = torch.zeros(S, dtype=torch.float32, device=device)
        layer.lora_indices = indices
    return targets


def clear_slot(layer: Linear, slot: int) -> None:
    nr = layer.lora_a.shape[0] // layer.lora_scaling.shape[0]
    layer.lora_a[slot * nr:(slot + 1) * nr].zero_()
    layer.lora_b[slot * nr:(slot + 1) * nr].zero_()
    layer.lora_scaling[slot] = 0.0


def write_slot(layer: Linear, slot: int, updates: dict[str | None, ModuleUpdate],
               max_rank: int) -> None:
    """Put one adapter's updates for this layer into `slot` (this rank's slices only:
    a column-parallel layer keeps its rows of B, a row-parallel one its columns of A).

    The slot has one scaling. Shards of a fused layer nearly always share it; when they
    do not (PEFT's rank_pattern / alpha_pattern), each shard's scaling is folded into
    its B and the slot's scaling is 1."""
    clear_slot(layer, slot)
    scalings = {u.scaling for u in updates.values()}
    fold = len(scalings) > 1
    nr = layer.lora_a.shape[0] // layer.lora_scaling.shape[0]
    a_slot = layer.lora_a[slot * nr:(slot + 1) * nr]
    bt_slot = layer.lora_b[slot * nr:(slot + 1) * nr]  # B^T
    for j, shard in enumerate(shard_names(layer)):
        u = updates.get(shard)
        if u is None:
            continue  # the adapter leaves this projection alone: its block stays zero
        r, col = u.a.shape[0], j * max_rank
        a, b = u.a, u.b
        if isinstance(layer, RowParallelLinear):
            k = layer.in_features
            a = a[:, tp_rank() * k:(tp_rank() + 1) * k]
        rows = slice(None)
        if shard is not None:
            s = layer.shards[shard]
            b = b[s.src_start:s.src_start + s.rows]
            rows = slice(s.offset, s.offset + s.rows)
        a_slot[col:col + r].copy_(a)
        bt_slot[col:col + r, rows].copy_((b * u.scaling if fold else b).t())
    layer.lora_scaling[slot] = 1.0 if fold else scalings.pop()
