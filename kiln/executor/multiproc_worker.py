"""The worker process of the `mp` executor (kiln.executor.multiproc): one rank.

Started as `python -m kiln.executor.multiproc_worker` with its arguments pickled on stdin.
It joins the world, builds its `Worker`, reports how that went, then serves the engine's
messages in order (kiln.executor.messages): a step to execute, an RPC to answer (by
`gather_object`, a collective), a keep-alive, or shutdown. Under pipeline parallelism
every rank executes every step (stages hand hidden states on, kiln.runner.pipeline_io);
one rank answers it: TP rank 0 of the last stage.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln.distributed.parallel_state import (destroy_distributed, init_distributed,
                                             initialize_model_parallel, timeout_s)
from kiln.executor.messages import recv_message, send_message
from kiln.executor.worker import RunnerSpec, Worker
from kiln.platforms import platform_for
from kiln.plugins import load_general_plugins

logger = logging.getLogger(__name__)

# A worker whose collective failed because a peer went away exits with this code, so the
# report can name the peer that died first rather than the ones that followed it.
PEER_LOST = 3


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    rank: int
    tp: int
    pp: int
    host: str  # where the engine (world rank tp * pp) listens
    port: int
    spec: RunnerSpec
    threads: int
    log_level: int
    # The CUDA device among those visible (None: the rank's own, all ranks on one host;
    # a Ray actor sees only its own GPU, 0)
    device_index: int | None = None

    @property
    def num_workers(self) -> int:
        return self.tp * self.pp

    @property
    def output_rank(self) -> int:
        """The rank that answers each step: TP rank 0 of the last stage."""
        return (self.pp - 1) * self.tp


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the engine) dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(a: WorkerArgs) -> None:
    _die_with_parent()
    logging.basicConfig(level=a.log_level, format=f"%(levelname)s rank{a.rank} %(name)s: "
                                                  "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    load_general_plugins()  # every kiln process, before the model is resolved
    torch.set_num_threads(a.threads)
    spec = a.spec
    if spec.device == "cuda":  # one device per rank, on this host
        platform = platform_for(spec.device)
        index = a.rank if a.device_index is None else a.device_index
        torch.cuda.set_device(platform.logical_device_id_to_visible_device_id(index))
    engine = a.num_workers
    init_distributed(engine + 1, a.rank, f"tcp://{a.host}:{a.port}")
    initialize_model_parallel(a.tp, torch.device(spec.device), a.num_workers, a.pp)
    spec.progress = spec.progress and a.rank == 0
    try:
        worker = Worker(spec)
        reply: tuple = ("ok", worker.describe())
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        logger.error("rank %d failed to start:\n%s", a.rank, traceback.format_exc())
        reply = ("error", type(exc).__name__, f"worker rank {a.rank}: {exc}")
    dist.gather_object(reply, None, dst=engine)
    if reply[0] == "error":
        _leave(0)
    try:
        _serve(worker, a.rank == a.output_rank, engine)
    except Exception as exc:  # noqa: BLE001 - the engine's watchdog turns our exit into its error
        if _peer_lost(exc):
            logger.error("rank %d lost a peer: %s", a.rank, str(exc).splitlines()[0])
            os._exit(PEER_LOST)
        logger.error("rank %d failed:\n%s", a.rank, traceback.format_exc())
        os._exit(1)
    _leave(0)


def _peer_lost(exc: Exception) -> bool:
    """A collective that failed because another process went away or hung (gloo raises
    these as plain RuntimeErrors; DistBackendError where torch classifies them)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection reset", "Connection closed", "Timed out", "timed out",
                            "gloo")))


def _serve(worker: Worker, answers: bool, engine: int) -> None:
    while True:
        # Bounded by the step bound: a silent engine is a dead one (an idle engine sends
        # keep-alives at a quarter of it).
        msg: Any = recv_message(engine, timeout_s())
        if msg[0] == "shutdown":
            worker.flush_pipeline()
            return
        if msg[0] == "execute":
            out = worker.execute(msg[1])
            if answers:
                send_message(out, engine)
        elif msg[0] == "rpc":
            dist.gather_object(getattr(worker, msg[1])(*msg[2]), None, dst=engine)
        # "ping": the engine was idle; a wait for a message is bounded like any other


def _leave(code: int) -> None:
    try:
        destroy_distributed()
    finally:
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":
    worker_main(pickle.load(sys.stdin.buffer))
