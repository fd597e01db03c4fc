"""AsyncLLMEngine: the synchronous `LLMEngine` driven by one background thread, with
results fanned out to asyncio streams, one per request.

Threading contract: `LLMEngine` is not thread-safe, so exactly one thread (the engine
thread) ever touches it. The event loop talks to that thread only through a command
queue (add, abort, LoRA add/remove, stop); the engine thread talks back only through
`loop.call_soon_threadsafe`. The torch work inside `step()` releases the GIL, so the event
loop keeps serving HTTP while the model runs.

LoRA contract: adapters are registered and unloaded on the engine thread, between steps;
an adapter that in-flight requests still use is unloaded after the last of them
(kiln.engine.lora_unloads).

Output contract: a stream yields DELTA outputs: each `RequestOutput` carries only the
completions that changed this step, and their `text`, `token_ids` and `logprobs` hold
just the new part, and a completion's finish_reason comes exactly once. The engine shapes
them itself (`output_kind=DELTA`), so no growing list is copied per step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from kiln.engine.llm_engine import LLMEngine
from kiln.engine.lora_unloads import LoRAUnloads
from kiln.engine.outputs import RequestOutput
from kiln.lora.request import LoRARequest
from kiln.sampling.params import RequestOutputKind, SamplingParams
from kiln.scheduler.step import SchedulerStats

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a bug in a step, or shutdown); no request can run."""


class StatsObserver(Protocol):
    """Receives per-request timings from the engine thread (must be thread-safe)."""

    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def record_tokens(self, num_new_tokens: int, inter_token_s: float | None) -> None: ...

    def record_finished(self, finish_reason: str, e2e_s: float) -> None: ...


class RequestStream:
    """What `AsyncLLMEngine.add_request` returns: iterate it for DELTA outputs; the last
    one has `finished=True`. Leaving the iteration early (client gone, cancellation) must be
    followed by `abort()`, which `iterate()` does itself."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:  # event-loop thread only
        self._queue.put_nowait(item)

    async def iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request if it has not finished (idempotent); its blocks are freed."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | dict[str, Any]
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future
    arrival: float  # time.monotonic() when the caller asked: TTFT includes queueing
    priority: int = 0
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _AddLoRA:
    lora_request: LoRARequest
    done: asyncio.Future


@dataclass(slots=True)
class _RemoveLoRA:
    lora_int_id: int
    done: asyncio.Future


_STOP = object()


@dataclass(slots=True)
class _Progress:
    """Engine-thread bookkeeping for one request: what was already sent, and timings."""

    stream: RequestStream
    arrival: float
    lora_int_id: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_finished: int = 0


class AsyncLLMEngine:
    """Serve many concurrent requests from one `LLMEngine`. Construct it inside a running
    event loop (or call `start()` there); `shutdown()` stops the engine thread."""

    def __init__(self, engine: LLMEngine, observer: StatsObserver | None = None,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self.on_dead = on_dead  # called from the engine thread when a step fails
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._progress: dict[str, _Progress] = {}  # engine thread only
        self._unloads = LoRAUnloads(engine)  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        self.stats: SchedulerStats = engine.get_stats()  # replaced by the engine thread
        # Requests per adapter name since start (a copy the engine thread publishes, so
        # readers such as /metrics never touch the engine).
        self.lora_request_counts: dict[str, int] = self._lora_counts()

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def add_request(self, request_id: str, prompt: str | dict[str, Any],
                          params: SamplingParams, *, priority: int = 0,
                          lora_request: LoRARequest | None = None,
                          kv_transfer_params: dict[str, Any] | None = None) -> RequestStream:
        """Queue a request; return its stream once the engine accepted it. A bad request
        (or adapter) raises `ValueError` here (nothing else is affected); a dead engine
        raises `EngineDeadError`."""
        # Streams carry only what is new: the engine shapes each output as a delta.
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self.start()
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        assert self._loop is not None
        stream = RequestStream(request_id, self)
        accepted = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, stream, accepted,
                                time.monotonic(), priority, lora_request,
                                kv_transfer_params))
        try:
            await accepted
        except asyncio.CancelledError:
            # Cancelled while queued: the engine may still add it, so abort it after the add.
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check and register an adapter on the engine thread (requests may then name
        it). A bad adapter, or LoRA being off, raises `ValueError`."""
        await self._submit(lambda done: _AddLoRA(lora_request, done))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (see the LoRA contract above); False if the engine did not
        know it. The id stays unusable until `add_lora` registers it again."""
        return await self._submit(lambda done: _RemoveLoRA(lora_int_id, done))

    async def _submit(self, make: Callable[[asyncio.Future], Any]) -> Any:
        self.start()
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        assert self._loop is not None
        done = self._loop.create_future()
        self._commands.put(make(done))
        return await done

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep until a command arrives. Busy: take what is there and step.
                block = not self.engine.has_unfinished_requests()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs, time.monotonic())
                self.stats = self.engine.get_stats()
                self.lora_request_counts = self._lora_counts()
        except BaseException as exc:  # a bug in a step, a dead worker: fail every request
            logger.exception("engine thread died")
            self.dead_error = exc
        finally:
            failed = self.dead_error is not None
            if not failed:
                self.dead_error = EngineDeadError("the engine was shut down")
            self._fail_all(self.dead_error)
            if failed and self.on_dead is not None:
                self.on_dead(self.dead_error)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False means stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _AddLoRA):
                self._add_lora(cmd)
            elif isinstance(cmd, _RemoveLoRA):
                self._remove_lora(cmd)

    def _add(self, cmd: _Add) -> None:
        lora = cmd.lora_request
        try:
            self._unloads.check_usable(lora)
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    priority=cmd.priority, lora_request=lora,
                                    kv_transfer_params=cmd.kv_transfer_params)
        except ValueError as exc:  # the request fails alone
            self._call(_resolve, cmd.accepted, exc)
            return
        lora_id = None if lora is None else lora.lora_int_id
        self._unloads.acquire(lora_id)
        self._progress[cmd.request_id] = _Progress(cmd.stream, cmd.arrival, lora_id)
        self._call(_resolve, cmd.accepted, None)

    def _add_lora(self, cmd: _AddLoRA) -> None:
        try:
            self.engine.add_lora(cmd.lora_request)
        except ValueError as exc:
            self._call(_resolve, cmd.done, exc)
            return
        self._unloads.registered(cmd.lora_request.lora_int_id)
        self._call(_resolve, cmd.done, None)

    def _remove_lora(self, cmd: _RemoveLoRA) -> None:
        self._call(_resolve, cmd.done, None, self._unloads.unload(cmd.lora_int_id))

    def _lora_counts(self) -> dict[str, int]:
        loras = self.engine.loras
        return {} if loras is None else dict(loras.request_counts)

    def _abort(self, request_id: str) -> None:
        progress = self._progress.pop(request_id, None)
        if progress is None:
            return  # already finished (or never accepted)
        self.engine.abort_request(request_id)
        self._unloads.release(progress.lora_int_id)
        if self.observer is not None:
            self.observer.record_finished("abort", time.monotonic() - progress.arrival)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            progress = self._progress.get(out.request_id)
            if progress is None:
                continue  # aborted in the meantime
            num_new = sum(len(c.token_ids) for c in out.outputs)
            self._observe(progress, out, num_new, now)
            if out.finished:
                del self._progress[out.request_id]
                self._unloads.release(progress.lora_int_id)
            if out.outputs or out.finished:
                self._call(progress.stream._put, out)

    def _observe(self, progress: _Progress, out: RequestOutput, num_new: int,
                 now: float) -> None:
        obs = self.observer
        if obs is None:
            return
        if num_new:
            if progress.first_token_time is None:
                progress.first_token_time = now
                obs.record_first_token(now - progress.arrival, len(out.prompt_token_ids))
                obs.record_tokens(num_new, None)
            else:
                obs.record_tokens(num_new, now - (progress.last_token_time or now))
            progress.last_token_time = now
        for c in out.outputs:
            if c.finish_reason is not None:
                obs.record_finished(c.finish_reason, now - progress.arrival)

    def _fail_all(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(str(exc))
        for progress in self._progress.values():
            self._call(progress.stream._put, error)
        self._progress.clear()
        while True:  # adds still queued: reject them
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._call(_resolve, cmd.accepted, error)
            elif isinstance(cmd, (_AddLoRA, _RemoveLoRA)):
                self._call(_resolve, cmd.done, error)

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


def _resolve(fut: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if fut.done():
        return  # its waiter was cancelled
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
