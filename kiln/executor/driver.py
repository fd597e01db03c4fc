"""The engine's side of executors whose ranks run elsewhere: `mp` (processes,
kiln.executor.multiproc) and `ray` (actors, kiln.executor.ray).

Transport, all torch.distributed (gloo): the engine joins the world as its last rank and
no TP or PP group. Each step it sends the scheduler output to every worker point to
point without waiting (kiln.executor.messages); TP rank 0 of the last pipeline stage
sends the runner output back; an RPC's results come back by `gather_object`. A broadcast
(what kiln used before pipeline parallelism) would wait for the busiest rank, so the
engine could not hand stage 0 its next micro-batch while the last stage computes. gloo
is kept over pipes (benchmarks/broadcast_transport.py: pipes were 10x cheaper per
message, 0.3 vs 3.0 ms, but a tp=2 step spends 5 ms of 360-400 in it): every message has
the same timeout and the same prompt error when a peer dies, on one host or many.

Pipelining (vLLM's batch queue): with pp stages up to pp steps are in flight
(`max_concurrent_batches`); `execute_async` returns a handle whose `result()` receives
the outputs in order. The scheduler never gives a request in flight more tokens than it
has, so two steps in flight never hold the same decode.

Supervision: a watchdog thread asks the subclass for dead ranks. When one dies it kills
the others, which makes any collective the engine is blocked in fail at once (their
sockets close), and the engine raises `WorkerDiedError` naming the rank. A peer that
hangs instead is bounded by the group timeout: KILN_DIST_STARTUP_TIMEOUT_S until the
first step, KILN_DIST_TIMEOUT_S from then on (parallel_state.py); an idle engine sends
keep-alives so that a worker's wait for work is never mistaken for a hang.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from kiln.distributed.parallel_state import (destroy_distributed, init_distributed,
                                             initialize_model_parallel, set_world_timeout,
                                             startup_timeout_s, timeout_s)
from kiln.distributed.hosts import free_port
from kiln.executor.abstract import Executor
from kiln.executor.messages import Outbox, recv_message
from kiln.executor.multiproc_worker import WorkerArgs
from kiln.executor.worker import RunnerSpec
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process exited or a collective failed: the engine cannot continue."""


class RankDriver(Executor):
    """`tp * pp` worker ranks elsewhere (processes, actors); this process is world rank
    `tp * pp`. Subclasses start, watch and stop the ranks (`_start_ranks`, `_find_dead`,
    `_kill_all`, `_wait_all`); everything said over torch.distributed is here."""

    def __init__(self, spec: RunnerSpec, tp: int, pp: int, host: str = "127.0.0.1",
                 threads: int = 1) -> None:
        self.tp_size, self.pp_size = tp, pp
        self.num_workers = self.engine_rank = n = tp * pp
        self.max_concurrent_batches = pp  # one micro-batch per stage in flight
        self._dead: str | None = None
        self._closing = False
        device = torch.device(spec.device)
        port = free_port(host)
        level = logging.getLogger().getEffectiveLevel()
        try:
            self._start_ranks([WorkerArgs(r, tp, pp, host, port, spec, threads, level)
                               for r in range(n)])
        except BaseException:  # those started so far, and what holds them, go too
            self._kill_all()
            self._released()
            raise
        self._output_rank = (pp - 1) * tp  # WorkerArgs.output_rank
        self._watchdog = threading.Thread(target=self._watch, name="kiln-watchdog",
                                          daemon=True)
        self._watchdog.start()
        self.send_s = 0.0  # engine-side time handing each step to the workers
        self._outbox = Outbox()
        self._lock = threading.Lock()  # one message at a time (the keep-alive thread too)
        self._last_send = time.monotonic()
        self._in_flight: deque[StepHandle] = deque()  # steps sent, results not received
        self._in_call = False  # an RPC between its message and its reply
        self._serving = False  # a step has run: collectives take the step bound
        try:
            init_distributed(n + 1, n, f"tcp://{host}:{port}")
            initialize_model_parallel(tp, device, n, pp)
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
        try:
            self._describe(_merge_stages([r[1] for r in replies]))
        except ValueError:
            self._stop(graceful=False)
            raise
        threading.Thread(target=self._keep_alive, name="kiln-keepalive", daemon=True).start()

    # ---- the ranks (subclasses) -----------------------------------------------------------
    def _start_ranks(self, args: list[WorkerArgs]) -> None:
        raise NotImplementedError

    def _find_dead(self) -> str | None:
        """A report naming the first rank found dead (and where it ran), or None."""
        raise NotImplementedError

    def _kill_all(self) -> None:
        raise NotImplementedError

    def _wait_all(self, seconds: float) -> None:
        """Wait up to `seconds` for every rank to end."""
        raise NotImplementedError

    def _released(self) -> None:
        """After the ranks are stopped and the world left: free what remains."""

    # ---- supervision ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            report = self._find_dead()
            if report is not None and not self._closing:
                if self._dead is None:
                    self._dead = report
                logger.error("%s; stopping the other workers", self._dead)
                self._kill_all()
                return
            time.sleep(0.1)

    def _keep_alive(self) -> None:
        """A worker waits for the engine's next message within the step bound, like any
        other message: while the engine is idle (a server without traffic) it sends a
        keep-alive at a quarter of the bound, so idleness never reads as a hung peer."""
        while not self._closing and self._dead is None:
            period = max(0.05, timeout_s() / 4)
            time.sleep(min(period, 1.0))
            if time.monotonic() - self._last_send >= period:
                try:
                    self._send(("ping",))
                except Exception:  # noqa: BLE001 - the watchdog or the next step reports it
                    return

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
        with self._lock:
            if self._closing:
                return
            self._outbox.send(msg, list(range(self.num_workers)))
            self._last_send = time.monotonic()

    def _gather(self) -> list[Any]:
        out: list[Any] = [None] * (self.num_workers + 1)
        dist.gather_object(None, out, dst=self.engine_rank)
        return out[: self.num_workers]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so).result()

    def execute_async(self, so: SchedulerOutput) -> StepHandle:
        """Hand the step to every worker and return at once; `result()` receives it.
        Results come back in the order steps were sent."""
        self.check_health()
        if not self._serving:  # start-up (load, compile, warm-up RPCs) is over
            set_world_timeout(timeout_s())
            self._serving = True
        start = time.perf_counter()
        try:
            self._send(("execute", so))
        except RuntimeError:
            raise self._error() from None
        self.send_s += time.perf_counter() - start
        handle = StepHandle(self)
        self._in_flight.append(handle)
        return handle

    def _receive_oldest(self) -> None:
        handle = self._in_flight[0]
        try:
            handle.output = recv_message(self._output_rank, timeout_s())
        except RuntimeError:
            raise self._error() from None
        self._in_flight.popleft()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        while self._in_flight:  # the answering rank sends those first
            self._receive_oldest()
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
        # Politely only between steps: interrupted mid-step (Ctrl-C, an error), the workers
        # wait in a different collective and a message would only hang to the timeout.
        graceful = graceful and not self._in_call and self._dead is None
        if graceful and self._find_dead() is None:
            try:
                while self._in_flight:
                    self._receive_oldest()
                self._send(("shutdown",))
                self._outbox.flush()
            except Exception:  # noqa: BLE001 - a worker went away meanwhile: force below
                graceful = False
        self._closing = True
        self._wait_all(10 if graceful else 0)
        self._kill_all()
        self._wait_all(5)
        destroy_distributed()
        self._released()


class StepHandle:
    """A step sent to the workers; `result()` receives it (and any sent before it)."""

    def __init__(self, executor: RankDriver) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        while self.output is None:
            self._executor._receive_oldest()
        return self.output


def _merge_stages(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One description for the scheduler from every rank's: the KV-cache groups must
    match (the scheduler hands every stage the same block tables), and the pool is the
    smallest rank's (stages of more layers fit fewer blocks in the same memory)."""
    groups = [[g.spec for g in info["kv_groups"]] for info in infos]
    if any(g != groups[0] for g in groups):
        raise ValueError("pipeline stages lay out their KV cache differently (their "
                         "layers mix sliding-window and full attention in other "
                         "proportions); set KILN_PP_LAYER_PARTITION so that each stage "
                         "holds the same mix, or use -pp 1")
    return {**infos[0], "num_kv_blocks": min(info["num_kv_blocks"] for info in infos)}


def describe_grid(tp: int, pp: int) -> str:
    parts = [f"tensor parallel {tp}"] * (tp > 1) + [f"pipeline parallel {pp}"] * (pp > 1)
    return " x ".join(parts) or "one worker"
