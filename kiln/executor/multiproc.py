"""`mp`: one spawned worker process per rank (`tp * pp` of them), on this host.

The engine side (messages, the batch queue's handles, RPCs, supervision) is
kiln.executor.driver's; this module starts, watches and stops the processes. Workers are
started as `python -m kiln.executor.multiproc_worker` with their arguments pickled on
stdin, not by multiprocessing's spawn: spawn re-imports the caller's main script, which
breaks every script without an `if __name__ == "__main__"` guard. From a process's
second `mp` engine on, they are forked from a zygote that has imported what a worker needs
once (kiln.executor.zygote); `KILN_WORKER_FORK=0`, or a zygote that cannot start, spawns
them. Workers die with the engine (PR_SET_PDEATHSIG), so a killed engine leaves no orphans.
"""
from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import time

import torch

from kiln.executor.driver import RankDriver, WorkerDiedError, describe_grid
from kiln.executor.multiproc_worker import PEER_LOST, WorkerArgs
from kiln.executor.worker import RunnerSpec
from kiln.executor.zygote import ForkedWorker, spawn_worker
from kiln.platforms.cpu import cpu_threads_per_rank

logger = logging.getLogger(__name__)
Proc = subprocess.Popen | ForkedWorker  # a spawned or a forked worker
__all__ = ["MultiprocExecutor", "WorkerDiedError"]


class MultiprocExecutor(RankDriver):
    def __init__(self, spec: RunnerSpec, tp: int, pp: int = 1) -> None:
        n = tp * pp
        cpu = torch.device(spec.device).type == "cpu"
        threads = cpu_threads_per_rank(n) if cpu else 1
        if cpu:
            logger.warning("%s: %d worker processes x %d CPU thread%s (%d CPUs here)",
                           describe_grid(tp, pp), n, threads, "s" * (threads > 1),
                           cpu_threads_per_rank(1))
        self.procs: list[Proc] = []
        super().__init__(spec, tp, pp, "127.0.0.1", threads)

    def _start_ranks(self, args: list[WorkerArgs]) -> None:
        self.procs = [_spawn(a) for a in args]

    def _find_dead(self) -> str | None:
        dead = [(r, p) for r, p in enumerate(self.procs) if p.poll() is not None]
        return _death_report(dead) if dead else None

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for p in self.procs:
            _wait(p, max(0.0, deadline - time.monotonic()))


def _death_report(dead: list[tuple[int, Proc]]) -> str:
    """Name the root cause among the workers found dead in one scan: killed by a signal
    first, then a worker's own failure, then those that only lost a peer."""
    def cause(item: tuple[int, Proc]) -> tuple[int, int]:
        code = item[1].returncode
        return (0 if code < 0 else 2 if code == PEER_LOST else 1, item[0])

    dead = sorted(dead, key=cause)
    rank, proc = dead[0]
    code = proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    report = f"worker rank {rank} (pid {proc.pid}) {how}"
    if len(dead) > 1:
        report += f"; rank {', '.join(str(r) for r, _ in dead[1:])} exited after it"
    return report


def _wait(proc: Proc, seconds: float) -> None:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def _spawn(args: WorkerArgs) -> Proc:
    try:
        forked = spawn_worker(args)
        if forked is not None:
            return forked
    except OSError as exc:
        logger.warning("forking rank %d failed (%s): starting it as a new process",
                       args.rank, exc)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.executor.multiproc_worker"],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc
