"""A request's output text: stop-string detection and the streaming hold-back buffer.

Invariants:
- A stop string is searched for only in the window the newest characters can complete
  (it may straddle token boundaries); the earliest-ending match wins.
- Text produced while the output is shorter than `min_tokens` is never stop-checked, so a
  stop string at the very start cannot end a request that must say more.
- While unfinished, the last (longest stop string - 1) characters are held back: a
  streamed delta never shows the start of a stop string that is then cut off.
"""
from __future__ import annotations

from kiln.sampling.params import SamplingParams


class OutputText:
    def __init__(self, params: SamplingParams) -> None:
        self.stop: list[str] = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.buffer_length = params.stop_buffer_length
        self.text = ""
        self._check_from = 0  # stop strings may start at or after this offset
        self._emitted = 0  # characters already returned as deltas

    def append(self, delta: str, num_output_tokens: int) -> str | None:
        """Add decoded text; return the stop string it completed (the text is then cut
        there, keeping the stop string only with include_stop_str_in_output)."""
        new_chars = len(delta)
        self.text += delta
        if num_output_tokens <= self.min_tokens:
            self._check_from = len(self.text)
            return None
        if not self.stop or not new_chars:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self.stop:
            lo = max(self._check_from, len(self.text) - new_chars - len(stop) + 1)
            start = self.text.find(stop, lo)
            if start != -1 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self.text = self.text[: end if self.include_stop else start]
        return stop

    def next_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: everything (or only what is new, for `delta`), minus
        the hold-back buffer while unfinished."""
        length = len(self.text) if finished else max(len(self.text) - self.buffer_length, 0)
        if not delta:
            return self.text[:length]
        if length <= self._emitted:
            return ""
        out = self.text[self._emitted: length]
        self._emitted = length
        return out
