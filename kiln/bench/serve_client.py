"""One streamed completion request against an OpenAI-compatible server, timed per chunk.

The SSE stream is read line by line; each `data: {...}` chunk carrying a choice is one
token event (kiln serve, like vLLM, streams one chunk per generated token). Times are
taken on arrival of each chunk, so TTFT includes queueing and prefill, and the gaps
between chunks are the inter-token latencies (ITL). A final `usage` chunk, when the
server sends one (`stream_options.include_usage`), gives exact token counts.
"""
from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

_LOCAL_NAMES = ("localhost", "localhost.localdomain")


def check_local_url(url: str) -> str:
    """The URL without a trailing slash, if it points at this machine; else ValueError.

    The benchmark sends bursts of requests: it is for a server you run here, never a
    remote one."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"url={url!r} must start with http:// or https://, e.g. "
                         "http://127.0.0.1:8000")
    host = parts.hostname or ""
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host.lower() in _LOCAL_NAMES
    if not local:
        raise ValueError(f"url={url!r}: kiln bench serve only targets a server on this "
                         "machine (localhost, 127.0.0.0/8 or [::1]); start one with "
                         "`kiln serve` and point --url at it")
    return url.rstrip("/")


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds from the moment it was sent."""

    ok: bool
    prompt_len: int  # as requested (or as the server's usage reports)
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send_completion(client: Any, url: str, payload: dict[str, Any],
                          prompt_len: int) -> RequestResult:
    """POST `payload` (with stream=True) and time the SSE chunks. Never raises for a bad
    response: a failed request is a result with ok=False and the reason."""
    result = RequestResult(ok=False, prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    events = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {body}"
                return result
            async for line in resp.aiter_lines():
                data = _sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"server error: {chunk['error']}"
                    return result
                usage = chunk.get("usage") or usage
                if not _is_token_event(chunk):
                    continue
                now = time.perf_counter()
                if events == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                events += 1
    except Exception as exc:  # connection reset, timeout, bad JSON: this request failed
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = int(usage["completion_tokens"]) if usage else events
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    result.ok = events > 0
    if not result.ok:
        result.error = "the stream ended without a token"
    return result


def _sse_data(line: str) -> str | None:
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments (": ping"), event/id fields
    return line[5:].strip()


def _is_token_event(chunk: dict[str, Any]) -> bool:
    """A chunk with a choice is one token, even with empty text: a model without a
    tokenizer, or a token the detokenizer holds back, streams "" (and the last token's chunk
    also carries the finish reason). The trailing usage-only chunk has no choice."""
    return bool(chunk.get("choices"))
