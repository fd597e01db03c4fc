"""Cumulative outputs → DELTA outputs, per request, for streaming.

Relies on the engine's cumulative text only ever growing at its end (the stop-string
hold-back guarantees it), so the new part is always a suffix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.engine.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class SentState:
    """What was already sent of one completion."""

    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


def to_delta(out: RequestOutput, sent: dict[int, SentState]) -> tuple[RequestOutput, int]:
    """The DELTA view of a cumulative output, and how many new tokens it holds. Updates
    `sent`. A completion that gained nothing and did not just finish is left out, so each
    completion reports its finish_reason exactly once."""
    changed: list[CompletionOutput] = []
    num_new = 0
    for c in out.outputs:
        s = sent.setdefault(c.index, SentState())
        if s.finished:
            continue
        logprobs = c.logprobs[s.logprobs:] if c.logprobs is not None else None
        new = dataclasses.replace(c, text=c.text[s.chars:], token_ids=c.token_ids[s.tokens:],
                                  logprobs=logprobs)
        s.chars, s.tokens = len(c.text), len(c.token_ids)
        s.logprobs = len(c.logprobs) if c.logprobs is not None else 0
        s.finished = c.finish_reason is not None
        if new.token_ids or new.text or s.finished:
            changed.append(new)
            num_new += len(new.token_ids)
    return dataclasses.replace(out, outputs=changed), num_new
