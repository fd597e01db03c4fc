"""`kiln serve -dp N`: one OpenAI-compatible endpoint in front of N engine replicas.

Routing: each request goes to the live replica with the fewest requests in flight, as
counted here (ties: round robin). vLLM's DP coordinator ranks engines by `4 * waiting +
running`, published by the engines every 100 ms, and adds the requests it sent since; a
router in front of every replica needs no published numbers: every request of every
replica passes through it, so its own in-flight count per replica is waiting + running,
exact and current. (It counts HTTP requests; one with n > 1 or a list of prompts counts
once.) /v1/models comes from the first live replica; runtime LoRA loads and unloads go to
every replica, so an adapter is servable wherever a request lands.

A replica that dies (its process exits, or it refuses connections or /health) is marked
dead and stays dead: its in-flight requests get a 502 (a stream: an error event, then
[DONE]); a request that could not even connect to it is sent to another replica, since
nothing ran; new requests go to the others. The front keeps serving on the survivors
rather than failing fast, because each request is independent and the others' in-flight
work is unharmed; /health stays 200 while one replica lives, and `kiln:dp_replica_up`
tells a scraper. Once none is left the front exits with status 1.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kiln.entrypoints.openai.dp_metrics import merge_expositions, router_exposition
from kiln.entrypoints.openai.dp_replicas import Replica
from kiln.entrypoints.openai.errors import APIError
from kiln.entrypoints.openai.guard import GuardMiddleware

logger = logging.getLogger(__name__)
MONITOR_S = 0.2  # how often the children's processes are polled
DISCONNECT_POLL_S = 0.2  # how fast a client that left is noticed (as kiln serve does)
_HEADERS = ("authorization", "content-type", "accept")  # passed on to a replica
_BROADCAST = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
T = TypeVar("T")


class Router:
    """The replicas' routing state; lives on the front's event loop only (no locks)."""

    def __init__(self, replicas: list[Replica], on_all_dead: Callable[[], None]) -> None:
        self.replicas = replicas
        self._on_all_dead = on_all_dead
        self._next = 0  # round robin among ties
        self._tasks: set[asyncio.Future[None]] = set()
        # keepalive_expiry below uvicorn's 5-s keep-alive timeout: a pooled connection the
        # child is closing would fail a request that never reached it.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=30.0), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=2.0))

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def pick(self, exclude: set[int]) -> Replica:
        n = len(self.replicas)
        live = [r for r in self.live if r.index not in exclude]
        if not live:
            raise APIError(503, "no engine replica is alive to serve this request",
                           code="no_replica")
        best = min(live, key=lambda r: (r.in_flight, (r.index - self._next) % n))
        self._next = (best.index + 1) % n
        return best

    def mark_dead(self, r: Replica, reason: str) -> None:
        if not r.alive:
            return
        r.alive, r.exit_reason = False, reason
        if r.proc.poll() is None:
            r.proc.kill()  # alive but not serving: dead means gone, never half-alive
        logger.error("engine replica %d (pid %d) %s: %d of %d replicas left", r.index,
                     r.proc.pid, reason, len(self.live), len(self.replicas))
        if not self.live:
            logger.error("every engine replica died: the front exits")
            self._on_all_dead()

    async def check(self, r: Replica) -> None:
        """After a transport error or a 503: dead if the process exited (allowing it a
        moment: the socket closes before the exit is visible) or /health says so."""
        for _ in range(10):
            if (how := r.describe_exit()) is not None:
                self.mark_dead(r, how)
                return
            await asyncio.sleep(0.1)
        try:
            ok = (await self.client.get(f"{r.url}/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.mark_dead(r, "stopped answering /health")

    async def monitor(self) -> None:
        while True:
            for r in self.live:
                if (how := r.describe_exit()) is not None:
                    self.mark_dead(r, how)
            await asyncio.sleep(MONITOR_S)

    async def failed(self, r: Replica, exc: BaseException) -> APIError:
        r.errors_total += 1
        await self.check(r)
        state = f"died ({r.exit_reason})" if not r.alive else \
            f"dropped the connection ({type(exc).__name__})"
        return APIError(502, f"engine replica {r.index} {state} while serving this "
                        "request; the other replicas still serve, so it may be retried",
                        code="replica_failed")

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        headers = {k: v for k in _HEADERS if (v := request.headers.get(k))}
        tried: set[int] = set()
        while True:
            r = self.pick(tried)
            r.in_flight += 1  # before the await: concurrent picks must see it
            req = self.client.build_request(request.method, r.url + path, content=body,
                                            params=request.url.query, headers=headers)
            try:
                upstream = await _unless_gone(request, self.client.send(req, stream=True))
            except (httpx.ConnectError, httpx.ConnectTimeout):
                r.in_flight -= 1  # it never reached the replica: another may serve it
                tried.add(r.index)
                await self.check(r)
                continue
            except httpx.HTTPError as exc:
                r.in_flight -= 1
                return (await self.failed(r, exc)).response()
            except BaseException:
                r.in_flight -= 1
                raise
            if upstream is None:  # the client left before the answer began
                r.in_flight -= 1
                return Response(status_code=499)
            break
        r.requests_total += 1
        if upstream.status_code == 503:  # the child's engine may have died: look now
            task = asyncio.ensure_future(self.check(r))
            self._tasks.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._tasks.discard)
        tag = {"x-kiln-dp-engine": str(r.index)}  # which replica served it (tests, logs)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return RelayedStream(self, r, upstream, tag)
        return await self._whole(request, r, upstream, tag)

    async def _whole(self, request: Request, r: Replica, upstream: httpx.Response,
                     tag: dict[str, str]) -> Response:
        """A non-streamed answer, read in full."""
        try:
            content = await _unless_gone(request, upstream.aread())
        except httpx.HTTPError as exc:
            return (await self.failed(r, exc)).response()
        finally:
            r.in_flight -= 1
            await upstream.aclose()
        if content is None:
            return Response(status_code=499)
        return Response(content, upstream.status_code, headers=tag,
                        media_type=upstream.headers.get("content-type"))

    async def broadcast(self, request: Request, path: str) -> Response:
        """Every live replica gets the request; the first failure, else replica 0's
        answer, is the client's."""
        body = await request.body()
        headers = {k: v for k in _HEADERS if (v := request.headers.get(k))}
        live = self.live
        if not live:
            raise APIError(503, "no engine replica is alive", code="no_replica")
        answers = await asyncio.gather(
            *(self.client.request(request.method, r.url + path, content=body,
                                  headers=headers) for r in live), return_exceptions=True)
        responses: list[httpx.Response] = []
        for r, a in zip(live, answers):
            if isinstance(a, BaseException):
                return (await self.failed(r, a)).response()
            responses.append(a)
        chosen = next((a for a in responses if a.status_code >= 300), responses[0])
        return Response(chosen.content, chosen.status_code,
                        media_type=chosen.headers.get("content-type"))

    async def first_live(self, request: Request) -> Response:
        """GET from replica 0, or the first live one after it (/v1/models: every
        replica serves the same model, and a read counts against no one's load)."""
        headers = {k: v for k in _HEADERS if (v := request.headers.get(k))}
        for r in self.live:
            try:
                resp = await self.client.get(r.url + request.url.path, headers=headers)
            except httpx.HTTPError:
                await self.check(r)
                continue
            return Response(resp.content, resp.status_code,
                            media_type=resp.headers.get("content-type"))
        raise APIError(503, "no engine replica is alive", code="no_replica")

    async def metrics(self) -> str:
        async def scrape(r: Replica) -> tuple[int, str] | None:
            try:
                resp = await self.client.get(f"{r.url}/metrics", timeout=10)
            except httpx.HTTPError:
                return None  # a dead one is found by the monitor or the next request
            return (r.index, resp.text) if resp.status_code == 200 else None

        texts = await asyncio.gather(*(scrape(r) for r in self.live))
        return merge_expositions(t for t in texts if t is not None) + \
            router_exposition(self.replicas)


class RelayedStream(StreamingResponse):
    """A replica's server-sent events, passed on whole events at a time, so that if the
    replica dies mid-stream the client gets a well-formed error event and [DONE] instead
    of half an event. However the response ends, the in-flight count drops once."""

    def __init__(self, router: Router, replica: Replica, upstream: httpx.Response,
                 tag: dict[str, str]) -> None:
        self._router, self._replica, self._upstream = router, replica, upstream
        self._closed = False
        super().__init__(self._events(), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type"),
                         headers={"Cache-Control": "no-cache", **tag})

    async def _events(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for chunk in self._upstream.aiter_raw():
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                if cut >= 2:
                    yield pending[:cut]
                    pending = pending[cut:]
        except httpx.HTTPError as exc:
            error = await self._router.failed(self._replica, exc)
            yield _sse(error.body()) + _sse("[DONE]")
            return
        if pending:
            yield pending

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._closed:
                self._closed = True
                self._replica.in_flight -= 1
                await self._upstream.aclose()


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client has gone: `work` is then cancelled,
    which closes the replica's connection, and the replica aborts the request as kiln
    serve does for its own clients (a non-streamed answer is awaited here for its whole
    generation, so this matters most there)."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def _broadcast_route(router: Router, path: str) -> Callable[[Request], Any]:
    async def route(request: Request) -> Response:
        return await router.broadcast(request, path)
    return route


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def build_router_app(replicas: list[Replica], api_key: str | None, max_body_bytes: int,
                     on_all_dead: Callable[[], None]) -> FastAPI:
    router = Router(replicas, on_all_dead)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        monitor = asyncio.ensure_future(router.monitor())
        yield
        monitor.cancel()
        await router.client.aclose()

    app = FastAPI(title="kiln data-parallel router", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    # The key is checked here too: /dp/replicas names pids, and a refused request should
    # not cost a replica anything. The body limit bounds what the front holds in memory.
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    async def api_error(_: Request, exc: Exception) -> Response:
        return exc.response() if isinstance(exc, APIError) else Response(status_code=500)

    app.add_exception_handler(APIError, api_error)

    @app.get("/health")
    async def health() -> Response:
        if not router.live:
            return APIError(503, "every engine replica died").response()
        return JSONResponse({"status": "ok", "replicas_alive": len(router.live),
                             "replicas": len(replicas)})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(await router.metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dp/replicas")
    async def list_replicas() -> Response:
        return JSONResponse([{"index": r.index, "pid": r.proc.pid, "url": r.url,
                              "alive": r.alive, "in_flight": r.in_flight,
                              "requests_total": r.requests_total,
                              "errors_total": r.errors_total,
                              "exit_reason": r.exit_reason} for r in replicas])

    @app.get("/v1/models")
    @app.get("/v1/models/{name:path}")
    async def models(request: Request) -> Response:
        return await router.first_live(request)

    for path in _BROADCAST:
        app.add_api_route(path, _broadcast_route(router, path), methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def anything(request: Request) -> Response:
        return await router.forward(request, request.url.path)

    app.state.router = router
    return app
