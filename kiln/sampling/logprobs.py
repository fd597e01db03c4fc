"""Logprobs: taken from the raw logits (before penalties and temperature, as vLLM v1
does), so users see the model's own distribution.

On the device they travel as `LogprobsTensors`: column 0 is the token that was chosen (or,
for prompt logprobs, the prompt's next token), columns 1..k the top-k alternatives. They
cross to the host in one `.tolist()` per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(slots=True)
class Logprob:
    """One entry of a position's logprobs dict (vLLM's shape)."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the chosen token plus the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [rows, 1 + k] int64
    logprobs: torch.Tensor  # [rows, 1 + k] float32
    ranks: torch.Tensor  # [rows] int64: rank of column 0's token

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.token_ids.tolist(), self.logprobs.tolist(),
                             self.ranks.tolist())


@dataclass(slots=True)
class LogprobsLists:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end],
                             self.ranks[start:end])

    def __len__(self) -> int:
        return len(self.ranks)


def gather_logprobs(logprobs: torch.Tensor, num_top: int, chosen: torch.Tensor
                    ) -> LogprobsTensors:
    """logprobs: [rows, vocab] float32 log-softmax; chosen: [rows] token ids.

    The chosen token's rank counts the tokens strictly more likely than it, plus one."""
    chosen = chosen.long()
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1))  # [rows, 1]
    ranks = (logprobs > chosen_lp).sum(-1) + 1
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([chosen.unsqueeze(-1), top_ids], dim=1)
        values = torch.cat([chosen_lp, top_lp], dim=1)
    else:
        token_ids, values = chosen.unsqueeze(-1), chosen_lp
    return LogprobsTensors(token_ids, values, ranks)


def to_position_dicts(lists: LogprobsLists, num_top: list[int] | int,
                      decode: Callable[[list[int]], list[str]] | None) -> list[PositionLogprobs]:
    """One dict per row, keeping the chosen token and the row's own top-`num_top` (rows
    were gathered with the batch's largest k). `decode(ids) -> list[str]` names tokens."""
    out: list[PositionLogprobs] = []
    for row, (ids, lps, rank) in enumerate(zip(lists.token_ids, lists.logprobs, lists.ranks)):
        k = num_top if isinstance(num_top, int) else num_top[row]
        ids, lps = ids[: 1 + k], lps[: 1 + k]
        names = decode(ids) if decode is not None else [None] * len(ids)
        entry: PositionLogprobs = {}
        for j in range(1, len(ids)):  # top-k first, so the dict reads in rank order
            entry[ids[j]] = Logprob(lps[j], j, names[j])
        if ids[0] not in entry:
            entry[ids[0]] = Logprob(lps[0], rank, names[0])
        out.append(entry)
    return out
