"""Prompt logprobs: for each prompt token after the first, its logprob (and rank, and the
top-k alternatives) given the tokens before it.

A prefill chunk covering positions [start, end) predicts tokens start+1 .. end; the last
position of the prompt predicts the first output token, which is not a prompt logprob.
Results carry the prompt index of their first row so a chunked (or, after preemption,
recomputed) prompt assembles by position without duplicates.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from kiln.sampling.logprobs import LogprobsLists, gather_logprobs
from kiln.sampling.params import SamplingParams

_ROWS_PER_PASS = 256  # bounds the [rows, vocab] float32 logits of a long prompt chunk


class PromptRow(Protocol):
    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, rows: Sequence[PromptRow],
                            num_scheduled: dict[str, int], query_start_loc: np.ndarray
                            ) -> dict[str, tuple[int, LogprobsLists]]:
    """`rows` in batch order; `query_start_loc[i]` is row i's first token in `hidden`."""
    result: dict[str, tuple[int, LogprobsLists]] = {}
    for i, row in enumerate(rows):
        k = row.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = row.num_computed_tokens
        count = min(start + num_scheduled[row.req_id], row.num_prompt_tokens - 1) - start
        if count <= 0:
            continue
        offset = int(query_start_loc[i])
        targets = torch.tensor(row.token_ids[start + 1: start + 1 + count], device=hidden.device)
        parts = []
        for lo in range(0, count, _ROWS_PER_PASS):
            hi = min(lo + _ROWS_PER_PASS, count)
            logprobs = compute_logits(hidden[offset + lo: offset + hi]).float().log_softmax(-1)
            parts.append(gather_logprobs(logprobs, k, targets[lo:hi]).tolists())
        result[row.req_id] = (start + 1, _concat(parts))
    return result


def _concat(parts: list[LogprobsLists]) -> LogprobsLists:
    return LogprobsLists([r for p in parts for r in p.token_ids],
                         [r for p in parts for r in p.logprobs],
                         [r for p in parts for r in p.ranks])
