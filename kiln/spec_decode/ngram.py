"""Prompt-lookup (n-gram) proposer: draft the tokens that followed the latest earlier
occurrence of the sequence's own suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are searched
for earlier in the sequence (prompt and output); the longest n that matches wins, and of
its matches the most recent one (text being repeated or edited continues where it was
last seen). Drafts are deterministic: to the rejection sampler they are one-hot.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k, self.lookup_min, self.lookup_max = k, lookup_min, lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured k) draft tokens; [] when nothing matches."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = tokens.shape[0]
        if k <= 0 or total <= self.lookup_min:
            return []
        # Candidate starts of a match: earlier positions holding the last token (the
        # match must end before the suffix itself, so it has a continuation).
        ends = np.flatnonzero(tokens[: total - 1] == tokens[-1])
        if ends.size == 0:
            return []
        best_end = -1
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            cand = ends[ends >= n - 1]
            if cand.size == 0:
                continue
            ok = np.ones(cand.size, dtype=bool)
            for j in range(1, n):  # compare the j-th token before each candidate end
                ok &= tokens[cand - j] == tokens[total - 1 - j]
            hits = cand[ok]
            if hits.size:
                best_end = int(hits[-1])
                break
        if best_end < 0:
            return []
        return tokens[best_end + 1: best_end + 1 + k].tolist()
