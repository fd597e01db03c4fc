"""`mp`: one spawned worker process per rank, driven by the engine process.

Transport, all torch.distributed (gloo): the engine joins the world as its last rank
(`tp`) and no TP group. Each step it broadcasts the scheduler output over the world group
(measured here against pipes: 5.4 vs 14.1 ms per step in /tmp-free micro runs, see
docs/distributed.md); rank 0 sends the runner output back point to point; an RPC's
results come back by `gather_object`.

Workers are started as `python -m kiln.distributed.mp_executor` with their arguments
pickled on stdin, not by multiprocessing's spawn: spawn re-imports the caller's main
script, which breaks every script without an `if __name__ == "__main__"` guard.

Supervision: a watchdog thread polls the worker processes. When one dies it
kills the others, which makes any collective the engine is blocked in fail at once
(their sockets close), and the engine raises `WorkerDiedError` naming the rank. A peer
that hangs instead is bounded by the group timeout (KILN_DIST_TIMEOUT_S). Workers die
with the engine (PR_SET_PDEATHSIG), so a killed engine leaves no orphans.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from kiln.distributed.executor import Executor
from kiln.distributed.parallel_state import (destroy_distributed, init_distributed,
                                             initialize_model_parallel, timeout_s)
from kiln.distributed.worker import RunnerSpec, Worker, cpu_threads_per_rank
from kiln.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process exited or a collective failed: the engine cannot continue."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, spec: RunnerSpec, tp: int) -> None:
        self.tp_size, self.engine_rank = tp, tp
        self._dead: str | None = None
        self._closing = False
        device = torch.device(spec.device)
        threads = cpu_threads_per_rank(tp) if device.type == "cpu" else 1
        if device.type == "cpu":
            logger.warning("tensor parallel: %d worker processes x %d CPU thread%s (%d "
                           "CPUs here)", tp, threads, "s" * (threads > 1),
                           cpu_threads_per_rank(1))
        port = _free_port()
        level = logging.getLogger().getEffectiveLevel()
        self.procs = [_spawn((r, tp, port, spec, threads, level)) for r in range(tp)]
        self._watchdog = threading.Thread(target=self._watch, name="kiln-watchdog",
                                          daemon=True)
        self._watchdog.start()
        try:
            init_distributed(tp + 1, tp, f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tp, device, tp)
            replies = self._gather()
        except BaseException:
            self.shutdown()
            raise self._error() from None
        errors = [r for r in replies if r[0] == "error"]
        if errors:
            self.shutdown()
            kind, message = errors[0][1], errors[0][2]
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        self._describe(replies[0][1])
        self.broadcast_s = 0.0  # engine-side time in the per-step broadcast

    # ---- supervision ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None and not self._closing:
                    self._dead = (f"worker rank {rank} (pid {proc.pid}) died with exit code "
                                  f"{code}")
                    logger.error("%s; stopping the other workers", self._dead)
                    self._kill_all()
                    return
            time.sleep(0.1)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def _error(self) -> WorkerDiedError:
        self._watchdog.join(5)  # the failed collective may beat the watchdog: let it name the rank
        return WorkerDiedError(self._dead or "a collective with the workers failed or timed "
                               f"out (KILN_DIST_TIMEOUT_S={timeout_s():.0f})")

    def check_health(self) -> None:
        if self._dead:
            raise WorkerDiedError(self._dead)

    # ---- messages ------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        dist.broadcast_object_list([msg], src=self.engine_rank)

    def _gather(self) -> list[Any]:
        out: list[Any] = [None] * (self.tp_size + 1)
        dist.gather_object(None, out, dst=self.engine_rank)
        return out[: self.tp_size]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            start = time.perf_counter()
            self._send(("execute", so))
            self.broadcast_s += time.perf_counter() - start
            reply: list[Any] = [None]
            dist.recv_object_list(reply, src=0)
        except RuntimeError:
            raise self._error() from None
        return reply[0]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        try:
            self._send(("rpc", method, args))
            return self._gather()
        except RuntimeError:
            raise self._error() from None

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group.
        Idempotent; safe from a finalizer."""
        if self._closing:
            return
        self._closing = True
        if self._dead is None and all(p.poll() is None for p in self.procs):
            try:
                self._send(("shutdown",))
            except Exception:  # noqa: BLE001 - a worker went away meanwhile: force below
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            _wait(p, max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for p in self.procs:
            _wait(p, 5)
        destroy_distributed()


def _wait(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def _spawn(args: tuple) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kiln.distributed.mp_executor"],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc


# ---- the worker process --------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the engine) dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker_main(rank: int, tp: int, port: int, spec: RunnerSpec, threads: int,
                 log_level: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: "
                                                "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    torch.set_num_threads(threads)
    engine = tp
    init_distributed(tp + 1, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(tp, torch.device(spec.device), tp)
    spec.progress = spec.progress and rank == 0
    try:
        worker = Worker(spec)
        reply: tuple = ("ok", worker.describe())
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        reply = ("error", type(exc).__name__, f"worker rank {rank}: {exc}")
    dist.gather_object(reply, None, dst=engine)
    if reply[0] == "error":
        _leave(0)
    try:
        _serve(worker, rank, engine)
    except Exception:  # noqa: BLE001 - the engine's watchdog turns our exit into its error
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    _leave(0)


def _serve(worker: Worker, rank: int, engine: int) -> None:
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=engine)
        msg = box[0]
        if msg[0] == "shutdown":
            return
        if msg[0] == "execute":
            out = worker.execute(msg[1])
            if rank == 0:
                dist.send_object_list([out], dst=engine)
        elif msg[0] == "rpc":
            dist.gather_object(getattr(worker, msg[1])(*msg[2]), None, dst=engine)


def _leave(code: int) -> None:
    try:
        destroy_distributed()
    finally:
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":
    _worker_main(*pickle.load(sys.stdin.buffer))
