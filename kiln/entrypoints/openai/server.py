"""`kiln serve`: its arguments and start-up (engine → app → warm-up → port)."""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import Any, Callable

from kiln.config import parse_bytes

logger = logging.getLogger(__name__)
DEAD_GRACE_S = 2.0  # how long /health says 503 before a server whose engine died exits
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what model=None (the embedded one) is


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags; the engine flags are added by the CLI's shared helper."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory or .gguf file (same as --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; use 0.0.0.0 "
                        "to serve the network, ideally with --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* "
                        "(default: $KILN_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model path, or "
                        f"{DEFAULT_MODEL_NAME} for the embedded model)")
    p.add_argument("--max-request-body-bytes", default="1MiB",
                   help="larger request bodies get 413 (default 1MiB)")


def _model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or DEFAULT_MODEL_NAME


def cmd_serve(args: argparse.Namespace, make_llm: Callable[[argparse.Namespace], Any]) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model given twice ({args.model_tag!r} and --model "
                             f"{args.model!r}): give one")
        args.model = args.model_tag
    if args.distributed_executor_backend == "external_launcher":
        raise ValueError("distributed_executor_backend='external_launcher' cannot serve: its "
                         "ranks each run an engine and only rank 0 would see requests; use "
                         "'mp' (the default with -tp N)")
    if not 0 < args.port < 65536:
        raise ValueError(f"port={args.port} must be in 1..65535")
    max_body = parse_bytes(args.max_request_body_bytes, "max_request_body_bytes")
    for name in (__name__, "kiln.entrypoints.openai.app", "kiln.engine.llm_engine"):
        logging.getLogger(name).setLevel(logging.INFO)  # start-up stages are always shown

    import uvicorn

    from kiln.entrypoints.openai.app import ServerSettings, build_app

    start = time.perf_counter()
    engine = make_llm(args).engine  # model load + compile (or compile-cache load)
    logger.info("start-up: engine %.1f s (model load and compile, -O%d)",
                time.perf_counter() - start, args.optimization_level)
    settings = ServerSettings(_model_name(args), args.api_key, max_body)
    died: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_dead(exc: BaseException) -> None:
        # In-flight requests already got their errors; /health answers 503 during the
        # grace period (for probes), then the server stops and the process exits 1.
        died.append(exc)
        logger.error("the engine died (%s): exiting in %.0f s", exc, DEAD_GRACE_S)
        threading.Timer(DEAD_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    app = build_app(engine, settings, on_dead)
    logger.info("serving '%s' on http://%s:%d once warm-up is done%s", settings.model_name,
                args.host, args.port, "" if settings.api_key else " (no API key)")
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
        access_log=args.verbose, timeout_graceful_shutdown=5))
    try:
        server.run()
    finally:
        engine.shutdown()  # the workers stop before the process exits, however it exits
    return 1 if died else 0
