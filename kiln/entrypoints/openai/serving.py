"""What both generation endpoints share: the serving context, starting engine requests,
merging their streams, accumulating choices, SSE framing, and disconnect handling.

Invariant: every engine request a handler starts is aborted on every way out that is not
its natural finish (error, client disconnect, cancellation), so no KV block outlives its
HTTP request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.entrypoints.openai.errors import APIError, from_value_error
from kiln.entrypoints.openai.params import sampling_fields
from kiln.lora.request import LoRAError, LoRARequest
from kiln.sampling.params import SamplingParams

T = TypeVar("T")
DISCONNECT_POLL_S = 0.2  # how fast a vanished non-streaming client is noticed


@dataclass(slots=True)
class ServingContext:
    """What a handler needs: the engine, the model name responses carry, and the LoRA
    adapter its requests run with (None: the base model)."""

    engine: AsyncLLMEngine
    model_name: str
    lora_request: LoRARequest | None = None
    tool_parser: str = "hermes"  # how `tool_choice="auto"` finds the model's tool calls

    def for_adapter(self, lora: LoRARequest | None) -> ServingContext:
        """The context of one request that named `lora` (responses carry its name)."""
        if lora is None:
            return self
        return dataclasses.replace(self, model_name=lora.lora_name, lora_request=lora)

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The generation config's fields, for those a request leaves unset."""
        return self.engine.engine.default_sampling


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def start_requests(ctx: ServingContext, base_id: str, prompts: list[dict[str, Any]],
                         params: list[SamplingParams], param: str,
                         kv_transfer_params: dict[str, Any] | None = None
                         ) -> list[RequestStream]:
    """Add one engine request per prompt; all or none (a rejected one aborts the rest).
    All adds are queued before any is awaited, so a batch costs one engine iteration."""
    results = await asyncio.gather(
        *(ctx.engine.add_request(f"{base_id}-{i}", prompt, p,
                                 lora_request=ctx.lora_request,
                                 kv_transfer_params=kv_transfer_params)
          for i, (prompt, p) in enumerate(zip(prompts, params))), return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return streams
    _abort(streams)
    exc = errors[0]
    if isinstance(exc, ValueError):
        # The engine's own checks: the prompt, or a token id in a sampling field.
        error = from_value_error(exc, sampling_fields())
        # An adapter that failed (unloaded meanwhile, or broken since): the model's fault.
        adapter = isinstance(exc, LoRAError)
        error.param = error.param or ("model" if adapter else param)
        raise error from None
    if isinstance(exc, EngineDeadError):
        raise APIError(503, f"the engine is not available: {exc}") from None
    raise exc


def _abort(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, DELTA output) from every stream as they arrive."""
    if len(streams) == 1:
        async for out in streams[0].iterate():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream.iterate():
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        _abort(streams)


@dataclass(slots=True)
class Choice:
    """One choice accumulated from its deltas (non-streaming responses and usage)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_error(exc: BaseException) -> APIError:
    return APIError(503, f"the engine failed while serving this request: {exc}")


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class AbortingStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends: finished,
    client gone, or cancelled before the body generator ever started."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _abort(self._streams)


async def until_disconnected(work: Awaitable[T], request: Request,
                             streams: list[RequestStream]) -> T | Response:
    """Await `work` unless the client goes away first; then abort and answer 499 (a
    response nobody reads, but the engine requests and their blocks are gone)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
    finally:
        if not task.done():
            task.cancel()
        _abort(streams)


def now() -> int:
    return int(time.time())
