"""The rank grid and one coordinator per process group.

A process knows up to three groups: the world (every rank, plus the engine process under
the `mp` executor), the tensor-parallel group and the pipeline-parallel group it belongs
to. Each `GroupCoordinator`
holds a device group for tensors (NCCL on CUDA, gloo on the CPU) and a CPU group (gloo)
for pickled metadata. The grid is laid out `[-1, pp, tp]` (vLLM's order, DP still 1): a TP
group is a row of one stage, a PP group the same TP rank down the stages, and global rank
= pp_rank * tp + tp_rank.

Without `init_distributed` every getter returns the trivial group of size 1, and its
collectives return their input unchanged: the single-process path never touches
torch.distributed and its graphs carry no collective at all.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln import envs
from kiln.platforms import platform_for

logger = logging.getLogger(__name__)

# The bound on any one collective or control message; a peer that hangs past it fails
# the step instead of hanging the engine. Generous, because start-up waits behind cold
# compiles (minutes on a small CPU).
DEFAULT_TIMEOUT_S = envs.DEFAULT_DIST_TIMEOUT_S


def timeout_s() -> float:
    """A serving step's bound (KILN_DIST_TIMEOUT_S)."""
    return envs.KILN_DIST_TIMEOUT_S


def startup_timeout_s() -> float:
    """The bound while the ranks start: connecting, loading, compiling
    (KILN_DIST_STARTUP_TIMEOUT_S; by default the larger of 600 s and the step bound). A
    short step bound, set to catch a hung peer fast, must not fail a start-up that waits
    behind cold compiles or a loaded host (a 5 s bound failed the gloo connect itself)."""
    return envs.KILN_DIST_STARTUP_TIMEOUT_S


def set_world_timeout(seconds: float) -> None:
    """Re-bound the world group's collectives from now on (start-up over: the step bound).
    torch has no public setter; its private one covers gloo and NCCL."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        logger.warning("this torch cannot change a process group's timeout: collectives "
                       "keep the start-up bound (%.0f s)", startup_timeout_s())
        return
    setter(datetime.timedelta(seconds=seconds), dist.group.WORLD)


@dataclass
class GroupCoordinator:
    """One group as seen by one process: `rank` is the position in `ranks` (global ranks);
    `device_group` carries tensors, `cpu_group` objects and barriers."""

    name: str
    ranks: list[int]
    rank: int = 0
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    stats: dict[str, float] = field(default_factory=lambda: {"all_reduce_s": 0.0,
                                                             "all_reduce_calls": 0})

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, out of place (the custom op's eager body)."""
        if self.world_size == 1:
            return x
        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.device_group)
        return out.view(self.world_size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place from group rank `src` (the sampled tokens, so every rank feeds the
        same ids to its next step)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)  # never NCCL: its barrier allocates on a GPU


# torch 2.13 renamed all_gather_into_tensor (the old name warns); 2.11 has only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


# The size-1 groups of a process that never initialised torch.distributed: built once,
# as eager layers ask for the TP size on every call.
_TRIVIAL_WORLD = GroupCoordinator("world", [0])
_TRIVIAL_TP = GroupCoordinator("tp", [0])
_TRIVIAL_PP = GroupCoordinator("pp", [0])


def get_world_group() -> GroupCoordinator:
    return _WORLD or _TRIVIAL_WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP or _TRIVIAL_TP


def get_pp_group() -> GroupCoordinator:
    return _PP or _TRIVIAL_PP


def tp_rank() -> int:
    return get_tp_group().rank


def tp_size() -> int:
    return get_tp_group().world_size


def device_backend(device: torch.device) -> str:
    """The device's collective backend: its platform's `dist_backend`."""
    return platform_for(device).dist_backend


def init_distributed(world_size: int, rank: int, init_method: str = "env://") -> None:
    """Join the world (gloo: it also carries the CPU groups); idempotent per process."""
    global _WORLD
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size,
                                rank=rank,
                                timeout=datetime.timedelta(seconds=startup_timeout_s()))
    _WORLD = GroupCoordinator("world", list(range(dist.get_world_size())), dist.get_rank(),
                              dist.group.WORLD, dist.group.WORLD)


def initialize_model_parallel(tp: int, device: torch.device, num_workers: int,
                              pp: int = 1) -> None:
    """Carve TP and PP groups out of the first `num_workers` world ranks (the engine
    process, if any, sits above them and joins neither). Every world rank must call this,
    in the same order: creating a group is itself a collective."""
    global _TP, _PP
    grid = torch.arange(num_workers).reshape(-1, pp, tp)  # [dp, pp, tp]
    _TP = _groups("tp", grid.reshape(-1, tp).tolist(), device) or _TP
    if pp > 1:  # without PP no rank asks for the group: create none (no extra collectives)
        _PP = _groups("pp", grid.transpose(1, 2).reshape(-1, pp).tolist(), device) or _PP
    for g in (_TP, _PP):
        if g is not None:
            logger.info("rank %d: %s rank %d of %d (ranks %s)", dist.get_rank(), g.name,
                        g.rank, g.world_size, g.ranks)


def _groups(name: str, all_ranks: list[list[int]], device: torch.device
            ) -> GroupCoordinator | None:
    """Create every group of one kind (all ranks take part in each creation); return
    the one this rank is in, if any."""
    me, mine = dist.get_rank(), None
    for ranks in all_ranks:
        cpu = dist.new_group(ranks, backend="gloo")
        dev = cpu if device.type == "cpu" else dist.new_group(ranks,
                                                                backend=device_backend(device))
        if me in ranks:
            mine = GroupCoordinator(name, ranks, ranks.index(me), dev, cpu)
    return mine


def destroy_distributed() -> None:
    """Leave every group (device groups first, then the world). Safe to call twice."""
    global _WORLD, _TP, _PP
    _TP = _PP = _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
