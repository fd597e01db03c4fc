"""Collectives as opaque custom ops, so Dynamo traces one graph per rank and Inductor
compiles around them (vLLM registers its collectives the same way).

The group is an argument by name ("tp"), resolved in the op's body, so the graph holds a
string, not a process-group object. Layers call these only when the group has more than
one rank: a single-process graph carries no collective at all, and its cache entries are
those of a build without tensor parallelism.
"""
from __future__ import annotations

import time

import torch

from kiln.distributed.parallel_state import GroupCoordinator, get_tp_group

_GROUPS = {"tp": get_tp_group}


def _group(name: str) -> GroupCoordinator:
    try:
        return _GROUPS[name]()
    except KeyError:
        raise ValueError(f"unknown process group {name!r}; kiln has {sorted(_GROUPS)}") \
            from None


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    g = _group(group)
    start = time.perf_counter()
    out = g.all_reduce(x)
    g.stats["all_reduce_s"] += time.perf_counter() - start
    g.stats["all_reduce_calls"] += 1
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _group(group).all_gather(x, dim)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _group(group).world_size
    return x.new_empty(shape)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln.all_reduce(x, "tp") if get_tp_group().world_size > 1 else x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if get_tp_group().world_size == 1:
        return x
    return torch.ops.kiln.all_gather(x, dim % x.dim(), "tp")
