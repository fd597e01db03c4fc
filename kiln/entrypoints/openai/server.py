"""`kiln serve`: its arguments and start-up (engine → app → warm-up → port)."""
from __future__ import annotations

import argparse
import logging
import threading
import time

from kiln import envs
from kiln.config.utils import parse_bytes
from kiln.entrypoints.args import make_llm
from kiln.entrypoints.openai.dp_replicas import add_data_parallel_args, check_data_parallel

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
    p.add_argument("--api-key", default=envs.KILN_API_KEY,
                   help="require 'Authorization: Bearer KEY' on /v1/* "
                        "(default: $KILN_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model path, or "
                        f"{DEFAULT_MODEL_NAME} for the embedded model)")
    p.add_argument("--max-request-body-bytes", default="1MiB",
                   help="larger request bodies get 413 (default 1MiB)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (turns LoRA on): NAME=PATH or JSON "
                        "'{\"name\": \"x\", \"path\": \"/p\"}'; a request's `model` "
                        "field picks one by NAME")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=envs.KILN_ALLOW_RUNTIME_LORA_UPDATING,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(turns LoRA on); default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING=True. "
                        "Any client with the API key can then make the server read a "
                        "directory: local use only")
    p.add_argument("--endpoint-plugins", default=None, metavar="NAME[,NAME]",
                   help="mount the HTTP routes of these kiln.endpoint_plugins entries "
                        "(none without this flag: routes are opt-in)")
    p.add_argument("--tool-call-parser", default="hermes",
                   help="how tool_choice='auto' finds the model's tool calls in its text "
                        "(default hermes: <tool_call>{...}</tool_call>)")
    p.add_argument("--pd-proxy", nargs=2, default=None, metavar=("P_URL", "D_URL"),
                   help="run no engine: proxy each request to the prefill instance P "
                        "(kv_producer), then to the decode instance D (kv_consumer)")
    p.add_argument("--pd-prefill-timeout", type=float, default=60.0, metavar="S",
                   help="with --pd-proxy: how long P may take before D computes the "
                        "prompt itself (default 60)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: kiln always serves "
                        "tool_choice='auto' with --tool-call-parser")
    add_data_parallel_args(p)  # -dp N: docs/distributed.md#data-parallel-serving


def _model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or DEFAULT_MODEL_NAME


def _lora_settings(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """Parse --lora-modules and turn LoRA on where an adapter may be served."""
    from kiln.entrypoints.openai.models import parse_lora_module

    modules = tuple(parse_lora_module(v) for v in args.lora_modules or ())
    names = [name for name, _ in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names {duplicates} more than once: give each "
                         "adapter its own name")
    reasons = [flag for flag, on in (("--lora-modules", modules),
                                     ("--allow-runtime-lora-updating",
                                      args.allow_runtime_lora_updating)) if on]
    args.enable_lora = args.enable_lora or bool(reasons)
    if args.enable_lora:
        logger.info("LoRA on (%s): max_loras=%d, max_lora_rank=%d",
                    " and ".join(reasons) or "--enable-lora", args.max_loras,
                    args.max_lora_rank)
    if args.allow_runtime_lora_updating:
        logger.warning("runtime LoRA updating is on: /v1/load_lora_adapter lets any client "
                       "with the API key make this server read a directory; use it only "
                       "locally")
    return modules


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())


def cmd_serve(args: argparse.Namespace) -> int:
    data_parallel = check_data_parallel(args)
    if args.pd_proxy is not None:
        from kiln.entrypoints.openai.pd_proxy import run_proxy

        logging.getLogger("kiln.entrypoints.openai.pd_proxy").setLevel(logging.INFO)
        return run_proxy(*args.pd_proxy, args.host, args.port, args.pd_prefill_timeout,
                         args.verbose)
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
    if data_parallel > 1:  # N child servers behind a router; this process runs no engine
        from kiln.entrypoints.openai.dp_serve import run_data_parallel

        return run_data_parallel(args, max_body)
    for name in (__name__, "kiln.entrypoints.openai.app", "kiln.engine.llm_engine",
                 "kiln.entrypoints.llm", "kiln.entrypoints.openai.serving_lora",
                 "kiln.sampling.defaults"):
        logging.getLogger(name).setLevel(logging.INFO)  # start-up stages are always shown
    lora_modules = _lora_settings(args)
    from kiln.entrypoints.openai.tool_parsers import make_tool_parser
    make_tool_parser(args.tool_call_parser)  # an unknown name fails before the model loads

    import uvicorn

    from kiln.entrypoints.openai.app import ServerSettings, build_app
    from kiln.entrypoints.openai.plugins import check_endpoint_plugins

    start = time.perf_counter()
    endpoint_plugins = _names(args.endpoint_plugins)
    check_endpoint_plugins(endpoint_plugins)  # a typo fails before the model loads
    llm = make_llm(args)  # model load + compile (or compile-cache load)
    engine = llm.engine
    logger.info("start-up: engine %.1f s (model load and compile, -O%d)",
                time.perf_counter() - start, args.optimization_level)
    settings = ServerSettings(_model_name(args), args.api_key, max_body,
                              model_root=args.model or DEFAULT_MODEL_NAME,
                              lora_modules=lora_modules,
                              allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                              tool_call_parser=args.tool_call_parser,
                              endpoint_plugins=endpoint_plugins)
    died: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_dead(exc: BaseException) -> None:
        # In-flight requests already got their errors; /health answers 503 during the
        # grace period (for probes), then the server stops and the process exits 1.
        died.append(exc)
        logger.error("the engine died (%s): exiting in %.0f s", exc, DEAD_GRACE_S)
        threading.Timer(DEAD_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    try:
        app = build_app(engine, settings, on_dead, llm.io_processor)  # a bad --lora-modules adapter fails here
        logger.info("serving '%s' on http://%s:%d once warm-up is done%s",
                    settings.model_name, args.host, args.port,
                    "" if settings.api_key else " (no API key)")
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port,
            log_level="info" if args.verbose else "warning", access_log=args.verbose,
            timeout_graceful_shutdown=5))
        server.run()
    finally:
        engine.shutdown()  # the workers stop before the process exits, however it exits
    return 1 if died else 0
