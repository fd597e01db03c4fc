"""`kiln serve -dp N`, start to end: start the replicas, wait until each is healthy, serve
the router (dp_router.py) until a signal or until every replica died, and stop every
replica on every way out (a SIGKILLed front is covered by dp_child.py's death signal)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from typing import Any

from kiln.entrypoints.openai.dp_ray import RayReplicaSet
from kiln.entrypoints.openai.dp_replicas import ReplicaSet, ReplicaStartError
from kiln.entrypoints.openai.dp_router import build_router_app

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 1800.0  # a cold compile of a large model on a CPU takes many minutes
ALL_DEAD_GRACE_S = 1.0  # lets the last error responses go out before the front exits


class _Stop(BaseException):
    """SIGINT or SIGTERM outside uvicorn's own handling (start-up, or the signal uvicorn
    raises again after its graceful shutdown): unwinds to the children's stop."""


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stop(signum)


def run_data_parallel(args: argparse.Namespace, max_body_bytes: int) -> int:
    """Start the replicas, wait for them, serve the router until a signal (exit 0) or
    until every replica died (exit 1); the children are stopped on every way out."""
    import uvicorn

    n = args.data_parallel_size
    argv = getattr(args, "argv", None)
    if argv is None:
        raise ValueError("data_parallel_size > 1 needs the command line to start the "
                         "replicas with: run it through `kiln serve` (kiln.cli.main)")
    for name in (__name__, "kiln.entrypoints.openai.dp_replicas",
                 "kiln.entrypoints.openai.dp_ray", "kiln.entrypoints.openai.dp_router"):
        logging.getLogger(name).setLevel(logging.INFO)
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.perf_counter()
    all_dead: list[bool] = []
    server: uvicorn.Server | None = None
    replicas: ReplicaSet | None = None

    def on_all_dead() -> None:
        all_dead.append(True)
        asyncio.get_running_loop().call_later(
            ALL_DEAD_GRACE_S, lambda: setattr(server, "should_exit", True))

    try:
        ranks = args.tensor_parallel_size * getattr(args, "pipeline_parallel_size", 1)
        # ray: the replicas as Ray actors' children on a cluster (dp_ray.py)
        kind = RayReplicaSet if args.data_parallel_backend == "ray" else ReplicaSet
        replicas = kind.start(argv, n, ranks)
        replicas.wait_healthy(STARTUP_TIMEOUT_S)
        logger.info("start-up: %d replicas ready in %.1f s; serving on http://%s:%d", n,
                    time.perf_counter() - start, args.host, args.port)
        app = build_router_app(replicas.replicas, args.api_key, max_body_bytes,
                               on_all_dead)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port,
            log_level="info" if args.verbose else "warning", access_log=args.verbose,
            timeout_graceful_shutdown=5))
        server.run()
    except _Stop:
        logger.info("data parallel: stopping the replicas")
    except ReplicaStartError as exc:  # its output is in the message
        logger.error("data parallel start-up failed: %s", exc)
        return 1
    finally:
        for s, handler in previous.items():  # a second Ctrl-C now interrupts the stop;
            signal.signal(s, handler)         # the children then die with us (pdeathsig)
        if replicas is not None:
            replicas.stop_all()
    return 1 if all_dead else 0
