"""Logprobs in OpenAI's two shapes, from kiln's `list[dict[int, Logprob]]` (one dict per
generated token: the sampled token plus the top-k)."""
from __future__ import annotations

import math
from typing import Any

_FLOOR = -9999.0  # JSON has no -inf: clamp, as OpenAI and vLLM do


def _lp(value: float) -> float:
    return _FLOOR if math.isnan(value) or value < _FLOOR else value


def _token(tokenizer: Any, token_id: int, entry: Any) -> str:
    text = getattr(entry, "decoded_token", None)
    if text is None:
        text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
    return text


def _ranked(step: dict[int, Any]) -> list[tuple[int, Any]]:
    """Entries best first: by rank where known, then by logprob."""
    return sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None
                                                 else math.inf, -kv[1].logprob))


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Any]], tokenizer: Any,
                        offset: int) -> tuple[dict[str, Any], int]:
    """`/v1/completions` shape: parallel lists; text_offset continues from `offset`.
    Returns the object and the offset after it."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for token_id, step in zip(token_ids, steps):
        token = _token(tokenizer, token_id, step.get(token_id))
        sampled = step.get(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(_lp(sampled.logprob) if sampled is not None else None)
        out["top_logprobs"].append({_token(tokenizer, t, e): _lp(e.logprob)
                                    for t, e in _ranked(step)})
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Any]], top_k: int,
                  tokenizer: Any) -> dict[str, Any]:
    """`/v1/chat/completions` shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`;
    top_logprobs holds the best `top_k` candidates (the sampled one only if among them)."""
    content = []
    for token_id, step in zip(token_ids, steps):
        sampled = step.get(token_id)
        token = _token(tokenizer, token_id, sampled)
        top = [{"token": (t := _token(tokenizer, tid, e)), "logprob": _lp(e.logprob),
                "bytes": list(t.encode("utf-8"))} for tid, e in _ranked(step)[:top_k]]
        content.append({"token": token,
                        "logprob": _lp(sampled.logprob) if sampled is not None else _FLOOR,
                        "bytes": list(token.encode("utf-8")), "top_logprobs": top})
    return {"content": content}
