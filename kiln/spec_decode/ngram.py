"""Prompt-lookup (n-gram) proposer: draft the tokens that followed the latest earlier
occurrence of the sequence's own suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are searched
for earlier in the sequence (prompt and output); the longest n that matches wins, and of
its matches the most recent one (text being repeated or edited continues where it was
last seen). Drafts are deterministic: to the rejection sampler they are one-hot.

The search is `bytes.rfind` over the tokens as 4-byte integers (`TokenBytes`), kept per
request and extended by each step's new tokens: a few C-speed scans where a numpy search
over the whole list took 110-160 us per step inside the engine (its Python and numpy
code run cache-cold after each forward has streamed the weights through the caches).
"""
from __future__ import annotations

from array import array
from typing import Sequence

_WIDTH = array("i").itemsize  # 4: token ids as native int32


class TokenBytes:
    """One sequence's tokens as native int32 bytes, brought up to date by `sync`."""

    __slots__ = ("data", "count")

    def __init__(self) -> None:
        self.data = bytearray()
        self.count = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        """Append what is new in `token_ids` (sequences only grow; a shorter one restarts)."""
        if len(token_ids) < self.count:
            self.data, self.count = bytearray(), 0
        if len(token_ids) > self.count:
            self.data += array("i", token_ids[self.count:]).tobytes()
            self.count = len(token_ids)

    def latest_end(self, n: int) -> int:
        """The end index of the latest earlier occurrence of the last n tokens that has a
        token after it (so not the suffix itself), or -1."""
        data, w = self.data, _WIDTH
        suffix = bytes(data[len(data) - n * w:])
        end = len(data) - w  # the occurrence must end before the last token
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                return -1
            if at % w == 0:
                return at // w + n - 1
            end = at + len(suffix) - 1  # a match across token boundaries: look further left


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k, self.lookup_min, self.lookup_max = k, lookup_min, lookup_max

    def propose(self, token_ids: Sequence[int], k: int | None = None,
                index: TokenBytes | None = None) -> list[int]:
        """Up to `k` (default: the configured k) draft tokens; [] when nothing matches.
        `index`: the sequence's TokenBytes, kept by the caller across steps."""
        return self.lookup(token_ids, k, index)[0]

    def lookup(self, token_ids: Sequence[int], k: int | None = None,
               index: TokenBytes | None = None) -> tuple[list[int], int]:
        """propose's draft and the length of the suffix it matched (0: no match)."""
        k = self.k if k is None else k
        total = len(token_ids)
        if k <= 0 or total <= self.lookup_min:
            return [], 0
        if index is None:
            index = TokenBytes()
        index.sync(token_ids)
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            end = index.latest_end(n)
            if end >= 0:
                return list(token_ids[end + 1: end + 1 + k]), n
        return [], 0
