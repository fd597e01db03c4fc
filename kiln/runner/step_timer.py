"""Decode-step timing for the cost-aware drafter (kiln.spec_decode.draft_length)."""
from __future__ import annotations

import time
from typing import Callable

from kiln.scheduler.output import SchedulerOutput


class DecodeStepTimer:
    """Times decode steps for the drafter (`observe(tokens, seconds)`): a step's cost is
    the time from its start to the next one's, its scheduling and output processing
    included (they grow with a step's tokens too), where both are decode steps (a token
    per request plus its drafts, no prefill rows). A decode step followed by anything
    else is not timed: what comes between may be a new request's arrival, or nothing."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self.observe = observe
        self._last: tuple[int, float] | None = None  # (tokens, start) of the last step

    def start(self, so: SchedulerOutput) -> None:
        now = time.perf_counter()
        drafted = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        decode = not so.is_empty and (so.total_num_scheduled_tokens - drafted
                                      == len(so.num_scheduled_tokens))
        if decode and self._last is not None:
            self.observe(self._last[0], now - self._last[1])
        self._last = (so.total_num_scheduled_tokens, now) if decode else None
