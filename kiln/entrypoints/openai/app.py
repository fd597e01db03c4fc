"""The FastAPI app: routes, error rendering, and the async engine's lifetime.

Start-up order: the `--lora-modules` adapters are checked (before the engine thread
exists, so touching the engine directly is safe); then, in the lifespan, which runs
before uvicorn opens the port, the engine thread starts and one tiny warm-up request runs
through the whole path (add, step, detokenize, fan-out), so the port only opens once a
request can be served.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.engine.async_engine import AsyncLLMEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.io_processor import IOProcessor
from kiln.entrypoints.openai.errors import APIError, bad_request, from_validation_error
from kiln.entrypoints.openai.guard import GuardMiddleware
from kiln.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kiln.entrypoints.openai.models import ServedModels
from kiln.entrypoints.openai.plugins import add_process_route, mount_endpoint_plugins
from kiln.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
from kiln.entrypoints.openai.serving import ServingContext
from kiln.entrypoints.openai.serving_chat import create_chat_completion
from kiln.entrypoints.openai.serving_completion import create_completion
from kiln.entrypoints.openai.serving_lora import (load_lora_adapter, require_runtime_updates,
                                                  unload_lora_adapter)
from kiln.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    model_root: str | None = None  # the base card's `root` (default: model_name)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) each
    allow_runtime_lora_updating: bool = False
    tool_call_parser: str = "hermes"
    endpoint_plugins: tuple[str, ...] = ()  # kiln.endpoint_plugins entries to mount


async def _warmup(engine: AsyncLLMEngine) -> None:
    observer, engine.observer = engine.observer, None  # keep warm-up out of the metrics
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        stream = await engine.add_request("warmup", {"prompt_token_ids": [0]}, params)
        async for _ in stream.iterate():
            pass
    finally:
        engine.observer = observer


async def _parse(request: Request, model: type[M]) -> M:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def build_app(engine: LLMEngine, settings: ServerSettings,
              on_dead: Callable[[BaseException], None] | None = None,
              io_processor: IOProcessor | None = None) -> FastAPI:
    """`on_dead` runs (on the engine thread) when a step fails for good, e.g. a dead
    worker: `kiln serve` uses it to exit non-zero after a short grace period."""
    models = ServedModels(settings.model_name, settings.model_root or settings.model_name,
                          engine.max_model_len)
    _register_lora_modules(engine, models, settings.lora_modules)
    lora_counts = None if engine.loras is None else lambda: async_engine.lora_request_counts
    metrics = ServerMetrics(lambda: async_engine.stats, lora_counts)
    async_engine = AsyncLLMEngine(engine, observer=metrics, on_dead=on_dead)
    ctx = ServingContext(async_engine, settings.model_name,
                         tool_parser=settings.tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start = time.perf_counter()
        async_engine.start()
        await _warmup(async_engine)
        logger.info("start-up: warm-up request %.2f s", time.perf_counter() - start)
        yield
        await async_engine.shutdown()

    app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key,
                       max_body_bytes=settings.max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return APIError(503, f"the engine is not running: {async_engine.dead_error}"
                            ).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": models.cards()})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> Response:
        return JSONResponse(models.card(name))

    # `model` picks the adapter (the base model's name, or none, runs without one).
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        return await create_completion(ctx.for_adapter(models.resolve(req.model)), req,
                                       request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        return await create_chat_completion(ctx.for_adapter(models.resolve(req.model)), req,
                                            request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        require_runtime_updates(settings.allow_runtime_lora_updating, request.url.path)
        req = await _parse(request, LoadLoRAAdapterRequest)
        return await load_lora_adapter(async_engine, models, req)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        require_runtime_updates(settings.allow_runtime_lora_updating, request.url.path)
        req = await _parse(request, UnloadLoRAAdapterRequest)
        return await unload_lora_adapter(async_engine, models, req)

    add_process_route(app, ctx, io_processor)
    mount_endpoint_plugins(app, settings.endpoint_plugins)  # opt-in, by name
    app.state.async_engine = async_engine
    app.state.models = models
    app.state.metrics = metrics
    return app


def _register_lora_modules(engine: LLMEngine, models: ServedModels,
                           modules: tuple[tuple[str, str], ...]) -> None:
    """Check every start-up adapter now: a bad one stops the server before it opens its
    port. Runs before the engine thread starts, so calling the engine here is safe."""
    if not modules:
        return
    for name, path in modules:
        try:
            lora = models.reserve(name, path)
            engine.add_lora(lora)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from None
        models.commit(lora)
        logger.info("LoRA adapter '%s' from %s (id %d)", name, path, lora.lora_int_id)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation_error(_: Request, exc: Exception) -> Response:
        return bad_request(str(exc)).response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, f"{exc.detail}: {request.method} "
                        f"{request.url.path}").response()

    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("internal error", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
