"""`mp`: one spawned worker process per rank, driven by the engine process.

Transport, all torch.distributed (gloo): the engine joins the world as its last rank
(`tp`) and no TP group. Each step it broadcasts the scheduler output over the world group;
rank 0 sends the runner output back point to point; an RPC's results come back by
`gather_object`. Measured against one pipe per worker (benchmarks/broadcast_transport.py,
2 workers, a 32-request decode step): gloo 3.0 ms, pipes 0.29 ms per step on a 2-vCPU VM.
gloo is kept: in the engine the broadcast is 5.3 ms of a 360-400 ms tp=2 step (the 62
all-reduces take 259 ms), and one transport gives every message the same timeout and
the same prompt error when a peer dies.

Workers are started as `python -m kiln.executor.multiproc` with their arguments
pickled on stdin, not by multiprocessing's spawn: spawn re-imports the caller's main
script, which breaks every script without an `if __name__ == "__main__"` guard.

Supervision: a watchdog thread polls the worker processes. When one dies it
kills the others, which makes any collective the engine is blocked in fail at once
(their sockets close), and the engine raises `WorkerDiedError` naming the rank. A peer
that hangs instead is bounded by the group timeout: KILN_DIST_STARTUP_TIMEOUT_S until the
first step, KILN_DIST_TIMEOUT_S from then on (parallel_state.py). Workers die
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

from kiln.distributed.parallel_state import (destroy_distributed, init_distributed,
                                             initialize_model_parallel, set_world_timeout,
                                             startup_timeout_s, timeout_s)
from kiln.executor.abstract import Executor
from kiln.executor.worker import RunnerSpec, Worker
from kiln.platforms import platform_for
from kiln.platforms.cpu import cpu_threads_per_rank
from kiln.plugins import load_general_plugins
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

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
        self.broadcast_s = 0.0  # engine-side time in the per-step broadcast
        self._in_call = False  # between a message's broadcast and its reply
        self._serving = False  # a step has run: collectives take the step bound
        try:
            init_distributed(tp + 1, tp, f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tp, device, tp)
            replies = self._gather()
        except BaseException:
            error = self._error()
            self._stop(graceful=False)
            raise error from None
        errors = [r for r in replies if r[0] == "error"]
        if errors:
            self._stop(graceful=False)
            kind, message = errors[0][1], errors[0][2]
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        self._describe(replies[0][1])

    # ---- supervision ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            dead = [(r, p) for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not self._closing:
                if self._dead is None:
                    self._dead = _death_report(dead)
                logger.error("%s; stopping the other workers", self._dead)
                self._kill_all()
                return
            time.sleep(0.1)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def _error(self) -> WorkerDiedError:
        """After a failed collective: the executor is dead for good (the workers sit in
        an unknown collective), and the error names the first worker that died."""
        self._watchdog.join(5)  # the collective may fail before the watchdog's next scan
        if self._dead is None:
            bound = (f"KILN_DIST_TIMEOUT_S={timeout_s():.0f}" if self._serving else
                     f"at start-up, KILN_DIST_STARTUP_TIMEOUT_S={startup_timeout_s():.0f}")
            self._dead = f"a collective with the workers failed or timed out ({bound})"
        self._kill_all()
        return WorkerDiedError(self._dead)

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
        if not self._serving:  # start-up (load, compile, warm-up RPCs) is over
            set_world_timeout(timeout_s())
            self._serving = True
        self._in_call = True
        try:
            start = time.perf_counter()
            self._send(("execute", so))
            self.broadcast_s += time.perf_counter() - start
            reply: list[Any] = [None]
            dist.recv_object_list(reply, src=0)
        except RuntimeError:
            raise self._error() from None
        self._in_call = False
        return reply[0]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        self._in_call = True
        try:
            self._send(("rpc", method, args))
            out = self._gather()
        except RuntimeError:
            raise self._error() from None
        self._in_call = False
        return out

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group.
        Idempotent; safe from a finalizer."""
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        if self._closing:
            return
        self._closing = True
        # Politely only between steps: interrupted mid-step (Ctrl-C, an error), the workers
        # wait in a different collective and a broadcast would only hang to the timeout.
        graceful = graceful and not self._in_call and self._dead is None
        if graceful and all(p.poll() is None for p in self.procs):
            try:
                self._send(("shutdown",))
            except Exception:  # noqa: BLE001 - a worker went away meanwhile: force below
                graceful = False
        deadline = time.monotonic() + (10 if graceful else 0)
        for p in self.procs:
            _wait(p, max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for p in self.procs:
            _wait(p, 5)
        destroy_distributed()


# A worker whose collective failed because a peer went away exits with this code, so the
# report can name the peer that died first rather than the ones that followed it.
PEER_LOST = 3


def _death_report(dead: list[tuple[int, subprocess.Popen]]) -> str:
    """Name the root cause among the workers found dead in one scan: killed by a signal
    first, then a worker's own failure, then those that only lost a peer."""
    def cause(item: tuple[int, subprocess.Popen]) -> tuple[int, int]:
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


def _wait(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def _spawn(args: tuple) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kiln.executor.multiproc"],
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
    load_general_plugins()  # every kiln process, before the model is resolved
    torch.set_num_threads(threads)
    if spec.device == "cuda":  # one device per rank, on this host
        platform = platform_for(spec.device)
        torch.cuda.set_device(platform.logical_device_id_to_visible_device_id(rank))
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
    except Exception as exc:  # noqa: BLE001 - the engine's watchdog turns our exit into its error
        if _peer_lost(exc):
            logger.error("rank %d lost a peer: %s", rank, str(exc).splitlines()[0])
            os._exit(PEER_LOST)
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        os._exit(1)
    _leave(0)


def _peer_lost(exc: Exception) -> bool:
    """A collective that failed because another process went away or hung (gloo raises
    these as plain RuntimeErrors; DistBackendError where torch classifies them)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection reset", "Connection closed", "Timed out", "timed out",
                            "gloo")))


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
