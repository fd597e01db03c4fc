"""ASGI middleware in front of every route: API-key check for every path but the probes'
(/health, /metrics: so /v1/*, /process and endpoint plugins' routes) and a request body
size limit. Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched."""
from __future__ import annotations

import hmac
from typing import Any

from kiln.entrypoints.openai.errors import APIError


# Open for probes and scrapers. Everything else needs the key when one is set, including
# routes plugins add (vLLM guards only /v1; a plugin's route is network exposure too).
OPEN_PATHS = frozenset({"/health", "/metrics"})


class GuardMiddleware:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        error = self._check_key(scope["path"], headers) or self._check_length(headers)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        received = 0
        limit = self.max_body_bytes

        async def limited_receive() -> dict[str, Any]:
            # A body without (or lying about) Content-Length is counted as it arrives;
            # the handler reading it gets the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
            return message

        await self.app(scope, limited_receive, send)

    def _check_key(self, path: str, headers: dict[str, str]) -> APIError | None:
        if not self.api_key or path in OPEN_PATHS:
            return None
        auth = headers.get("authorization", "")
        if not auth:
            return APIError(401, "missing API key: send the header 'Authorization: Bearer "
                            "<key>'", None, "invalid_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            return APIError(401, "incorrect API key provided", None, "invalid_api_key")
        return None

    def _check_length(self, headers: dict[str, str]) -> APIError | None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} "
                    "bytes (--max-request-body-bytes)", None, "request_too_large")
