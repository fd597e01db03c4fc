"""Per-step sampling inputs, one row per request that samples this step.

Built on the host from the runner's request states; every optional processor is `None`
when no row in the batch uses it, so the common case (greedy, or plain temperature)
pays for nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from kiln.sampling.params import SamplingParams


class SamplingRow(Protocol):
    """What the metadata builder reads from a runner request state."""

    sampling_params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


@dataclass(slots=True)
class Penalties:
    prompt_mask: torch.Tensor  # [R, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [R, V] float32: occurrences in the output so far
    repetition: torch.Tensor  # [R] float32 (1 = off)
    presence: torch.Tensor  # [R] float32 (0 = off)
    frequency: torch.Tensor  # [R] float32 (0 = off)


@dataclass(slots=True)
class SparseLogits:
    """(row, token) pairs with a value: logit biases, or -inf masks."""

    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass(slots=True)
class GrammarMask:
    """Structured output: the constrained rows and their packed allowed-token bits."""

    rows: torch.Tensor  # [G] int64 sampling rows
    bitmask: torch.Tensor  # [G, ceil(V/32)] int32


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float32; rows < eps are greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] int64, 0 = keep all
    top_p: torch.Tensor | None  # [R] float32, 1 = keep all
    min_p: torch.Tensor | None  # [R] float32, 0 = off
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)
    # Set when every row has a top_k: the filter then needs only a partial top-k, not a
    # sort of the whole vocabulary (~70x cheaper on a CPU at vocab 49k).
    max_top_k: int | None = None
    max_num_logprobs: int | None = None  # None: no row asked for logprobs
    num_logprobs: list[int] | None = None  # per row (0 where not asked)
    penalties: Penalties | None = None
    logit_bias: SparseLogits | None = None
    min_tokens_mask: SparseLogits | None = None  # stop tokens banned until min_tokens
    grammar: GrammarMask | None = None  # structured output, applied before anything else

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device,
              vocab_size: int) -> SamplingMetadata:
        params = [r.sampling_params for r in rows]
        all_greedy = all(p.is_greedy for p in params)
        md = cls(_floats([p.temperature for p in params], device), all_greedy, None, None,
                 None, {i: r.generator for i, r in enumerate(rows) if r.generator is not None})
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                md.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64,
                                        device=device)
                if all(0 < p.top_k < vocab_size for p in params):
                    md.max_top_k = max(p.top_k for p in params)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = _floats([p.top_p for p in params], device)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = _floats([p.min_p for p in params], device)
        if any(p.logprobs is not None for p in params):
            md.num_logprobs = [p.logprobs or 0 for p in params]
            md.max_num_logprobs = max(md.num_logprobs)
        if any(p.has_penalties for p in params):
            md.penalties = _penalties(rows, device, vocab_size)
        md.logit_bias = _sparse([(i, t, b) for i, p in enumerate(params)
                                 for t, b in (p.logit_bias or {}).items()], device)
        md.min_tokens_mask = _sparse(_min_tokens_bans(rows), device)
        return md


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _penalties(rows: Sequence[SamplingRow], device: torch.device, vocab: int) -> Penalties:
    n = len(rows)
    prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        if not r.sampling_params.has_penalties:
            continue
        prompt = torch.tensor(r.token_ids[: r.num_prompt_tokens], device=device)
        prompt_mask[i, prompt] = True
        output = r.token_ids[r.num_prompt_tokens:]
        if output:
            counts[i] = torch.bincount(torch.tensor(output, device=device),
                                       minlength=vocab)[:vocab].float()
    ps = [r.sampling_params for r in rows]
    return Penalties(prompt_mask, counts, _floats([p.repetition_penalty for p in ps], device),
                     _floats([p.presence_penalty for p in ps], device),
                     _floats([p.frequency_penalty for p in ps], device))


def _min_tokens_bans(rows: Sequence[SamplingRow]) -> list[tuple[int, int, float]]:
    """Rows still short of min_tokens may not sample EOS or a stop token."""
    bans = []
    for i, r in enumerate(rows):
        p = r.sampling_params
        if not p.min_tokens or len(r.token_ids) - r.num_prompt_tokens >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        bans.extend((i, t, float("-inf")) for t in sorted(stops))
    return bans


def _sparse(entries: list[tuple[int, int, float]], device: torch.device
            ) -> SparseLogits | None:
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return SparseLogits(torch.tensor(rows, dtype=torch.int64, device=device),
                        torch.tensor(tokens, dtype=torch.int64, device=device),
                        _floats(list(values), device))


def grammar_rows(sample_ids: list[str], rows_of: dict[str, int], bitmask: np.ndarray,
                 device: torch.device) -> GrammarMask | None:
    """Match the scheduler's bitmask rows (by request id) to this step's sampling rows."""
    pairs = [(i, rows_of[rid]) for i, rid in enumerate(sample_ids) if rid in rows_of]
    if not pairs:
        return None
    rows, src = zip(*pairs)
    return GrammarMask(torch.tensor(rows, dtype=torch.int64, device=device),
                       torch.from_numpy(bitmask[list(src)]).to(device))
