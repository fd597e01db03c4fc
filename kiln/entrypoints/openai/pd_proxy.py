"""`kiln serve --pd-proxy P_URL D_URL`: prefill/decode disaggregation behind one URL.

Each completion or chat request goes first to the prefill instance P (`kv_role:
kv_producer`) with `max_tokens: 1`, `n: 1`, no streaming and `kv_transfer_params:
{"do_remote_decode": true}`: P computes the prompt and publishes its KV. Then the original
request goes to the decode instance D (`kv_consumer`) with `{"do_remote_prefill": true}`:
D waits (up to its `remote_timeout_s`) for those blocks, loads them and generates; its
answer, streamed or not, is passed through unchanged. If P fails or times out, D gets the
request without the flag and computes the prompt itself.
"""
from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)
DEFAULT_PREFILL_TIMEOUT_S = 60.0
_PREFILL_ONLY = {"max_tokens": 1, "n": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
_DROP_FOR_PREFILL = ("max_completion_tokens", "stream_options", "min_tokens", "best_of")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    out.update(_PREFILL_ONLY)
    return out


def build_proxy_app(prefill_url: str, decode_url: str,
                    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S) -> FastAPI:
    # Handlers' annotations must resolve at module level: FastAPI reads them to tell the
    # request object from query parameters.
    app = FastAPI(title="kiln P/D proxy")
    client = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False)
    p_base, d_base = prefill_url.rstrip("/"), decode_url.rstrip("/")
    stats = {"requests": 0, "prefill_failures": 0}

    def _headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    async def _prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> bool:
        try:
            r = await client.post(p_base + path, json=prefill_body(body), headers=headers,
                                  timeout=prefill_timeout_s)
        except httpx.HTTPError as exc:
            logger.warning("prefill instance failed (%s): decode computes the prompt", exc)
            return False
        if r.status_code != 200:
            logger.warning("prefill instance answered %d: decode computes the prompt",
                           r.status_code)
            return False
        return True

    async def _forward(request: Request, path: str) -> Response:
        body = await request.json()
        headers = _headers(request)
        stats["requests"] += 1
        decode = dict(body)
        if isinstance(body, dict) and await _prefill(path, body, headers):
            decode["kv_transfer_params"] = {"do_remote_prefill": True}
        else:
            stats["prefill_failures"] += 1
        req = client.build_request("POST", d_base + path, json=decode, headers=headers)
        resp = await client.send(req, stream=True)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 background=BackgroundTask(resp.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await client.get(d_base + "/v1/models", headers=_headers(request))
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """Healthy when D is (P may be down: D then computes prompts itself)."""
        try:
            r = await client.get(d_base + "/health", timeout=5)
        except httpx.HTTPError:
            return Response(status_code=503)
        return Response(status_code=r.status_code)

    @app.get("/proxy_stats")
    async def proxy_stats() -> dict[str, int]:
        return dict(stats)

    @app.on_event("shutdown")
    async def close() -> None:
        await client.aclose()

    return app


def run_proxy(prefill_url: str, decode_url: str, host: str, port: int,
              prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
              verbose: bool = False) -> int:
    import uvicorn

    for url, name in ((prefill_url, "P_URL"), (decode_url, "D_URL")):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--pd-proxy {name}={url!r} must be an http(s):// URL")
    logger.info("P/D proxy on http://%s:%d: prefill %s, decode %s", host, port,
                prefill_url, decode_url)
    uvicorn.run(build_proxy_app(prefill_url, decode_url, prefill_timeout_s), host=host,
                port=port, log_level="info" if verbose else "warning")
    return 0
