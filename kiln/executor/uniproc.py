"""In-process executors: the worker lives in this process.

- `uni`: one in-process worker, tensor parallel size 1 (the default path).
- `external_launcher`: `torchrun` started every rank; each runs the whole engine
  deterministically (same requests, same schedule, same seeds) with one in-process
  worker, and only rank 0 hands outputs to the caller.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
from typing import Any

import torch

from kiln.distributed.parallel_state import (destroy_distributed, get_tp_group,
                                             init_distributed, initialize_model_parallel)
from kiln.executor.abstract import Executor
from kiln.executor.worker import RunnerSpec, Worker
from kiln.platforms import platform_for
from kiln.platforms.cpu import cpu_threads_per_rank
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class InProcessExecutor(Executor):
    """The worker lives in this process (`uni`, and each rank under `external_launcher`)."""

    def __init__(self, spec: RunnerSpec) -> None:
        self.worker = Worker(spec)
        self._describe(self.worker.describe())

    @property
    def runner(self) -> Any:
        return self.worker.runner

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(so)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.close()  # saves in flight land before the engine goes


class ExternalLauncherExecutor(InProcessExecutor):
    """One rank of a `torchrun` job: the world is the job (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), every rank in one TP group for now."""

    def __init__(self, spec: RunnerSpec, tp: int) -> None:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' needs the "
                             f"environment torchrun sets ({', '.join(missing)} missing): run "
                             "`torchrun --nproc-per-node N script.py`")
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ValueError(f"tensor_parallel_size={tp} but torchrun started {world} ranks "
                             "(WORLD_SIZE): they must be equal until pipeline and data "
                             "parallelism exist")
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device(spec.device)
        if device.type == "cuda":  # the local rank's device, through the control variable
            torch.cuda.set_device(
                platform_for(device).logical_device_id_to_visible_device_id(local))
        else:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            threads = cpu_threads_per_rank(local_ranks)
            torch.set_num_threads(threads)
            logger.info("rank %s: %d CPU threads (%d ranks on this host)",
                        os.environ["RANK"], threads, local_ranks)
        init_distributed(world, int(os.environ["RANK"]))
        _leave_world_at_exit()
        initialize_model_parallel(tp, device, world)
        self.tp_size = tp
        self.is_driver = get_tp_group().rank == 0
        super().__init__(spec)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        import torch.distributed as dist

        mine = getattr(self.worker, method)(*args)
        out: list[Any] = [None] * self.tp_size
        dist.all_gather_object(out, mine, group=get_tp_group().cpu_group)
        return out

    # shutdown: nothing to stop. The world belongs to the torchrun job: it stays joined
    # until the process exits, so a script may build several engines in turn (each
    # carves fresh TP groups).


_LEAVE_REGISTERED = False


def _leave_world_at_exit() -> None:
    """Once per process: at interpreter exit, wait for every rank, then leave the world.
    Without it a rank could exit (and rank 0 tear down the store it hosts) while a peer
    still talks to it; that race aborted rank 0 at exit about once in a dozen runs."""
    global _LEAVE_REGISTERED
    if _LEAVE_REGISTERED:
        return
    _LEAVE_REGISTERED = True

    def leave() -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        try:  # a dead peer must not hang the exit: monitored_barrier times out and names it
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except RuntimeError as e:
            logger.warning("leaving the torchrun world without every rank: %s", e)
        destroy_distributed()

    atexit.register(leave)
