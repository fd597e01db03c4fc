"""The sampling half of a runner step: logits for the rows that sample, the sampler, the
verification of draft tokens, and the tokens and logprobs handed back.

Without drafts each sampling request has one row. A request verifying k drafts has
k + 1 rows (the target's distribution after each prefix of its drafts); the rejection
sampler turns them into the 1..k+1 tokens the request emits. Row j sees the prefix plus
drafts 1..j in its penalties and min_tokens bans, so greedy verification reproduces
decoding without speculation exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kiln.distributed.parallel_state import get_tp_group
from kiln.sampling.logprobs import gather_logprobs
from kiln.sampling.metadata import SamplingMetadata, grammar_rows
from kiln.sampling.params import SamplingParams
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kiln.spec_decode.rejection import DraftRows, verify

from kiln.models.model_config import ModelConfig
from kiln.runner.state import CachedRequestState
from kiln.sampling.sampler import Sampler


class SamplingRunner(Protocol):
    """What the sampling step reads of its runner (a `ModelRunner`)."""

    device: torch.device
    config: ModelConfig
    model: torch.nn.Module
    sampler: Sampler


@dataclass(slots=True)
class _DraftPrefixRow:
    """A sampling row of a request's j-th draft position (the SamplingRow protocol)."""

    state: CachedRequestState
    j: int  # drafts before this row

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params

    @property
    def token_ids(self) -> list[int]:  # read only for penalties and min_tokens
        return self.state.token_ids + self.state.spec_token_ids[: self.j]

    @property
    def num_prompt_tokens(self) -> int:
        return self.state.num_prompt_tokens

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.state.eos_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.state.generator


def sample_step(runner: SamplingRunner, hidden: torch.Tensor, states: list[CachedRequestState],
                out: ModelRunnerOutput, so: SchedulerOutput) -> dict[str, list[int]]:
    """Sample (and verify) every request in `states`, whose logits rows `hidden` holds
    in order; append the emitted tokens to each state and put the logprobs asked for
    into `out`. One host transfer for the tokens, one for the logprobs."""
    spec = any(s.spec_token_ids for s in states)
    rows = [_DraftPrefixRow(s, j) for s in states for j in range(len(s.spec_token_ids) + 1)] \
        if spec else states
    md = SamplingMetadata.build(rows, runner.device, runner.config.vocab_size)
    if so.grammar_bitmask is not None:  # constrained requests have no drafts: one row each
        md.grammar = grammar_rows([r.state.req_id if spec else r.req_id for r in rows],
                                  so.structured_output_request_ids, so.grammar_bitmask,
                                  runner.device)
    logits = runner.model.compute_logits(hidden)  # [rows, vocab]
    result = runner.sampler(logits, md, keep=spec)
    if spec:
        tokens, chosen_rows = _verify(result, states)
        tokens = _broadcast_tokens(tokens, runner.device)
    else:  # one token per request: rank 0's sampled tensor as it is
        sampled_ids = get_tp_group().broadcast(result.sampled, src=0).tolist()
        tokens, chosen_rows = [[t] for t in sampled_ids], list(range(len(states)))
    _logprobs(result, md, states, tokens, chosen_rows, out, spec)
    sampled: dict[str, list[int]] = {}
    for state, emitted in zip(states, tokens):
        state.token_ids.extend(emitted)
        sampled[state.req_id] = emitted
    return sampled


def _verify(result, states: list[CachedRequestState]) -> tuple[list[list[int]], list[int]]:
    requests, first = [], 0
    for s in states:
        requests.append(DraftRows(first, s.spec_token_ids, s.sampling_params, s.generator))
        first += len(s.spec_token_ids) + 1
    return verify(result, requests), [r.first for r in requests]


def _broadcast_tokens(tokens: list[list[int]], device: torch.device) -> list[list[int]]:
    """Every rank verified the same gathered logits; rank 0's tokens (1..k+1 per request,
    padded with -1 to one width) become everyone's, so the ranks' next inputs can never
    diverge (e.g. an unseeded random draw)."""
    group = get_tp_group()
    if group.world_size == 1:
        return tokens
    width = max(len(t) for t in tokens)
    flat = torch.tensor([t + [-1] * (width - len(t)) for t in tokens], dtype=torch.int64,
                        device=device)
    flat = group.broadcast(flat, src=0).tolist()
    return [[t for t in row if t >= 0] for row in flat]


def _logprobs(result, md: SamplingMetadata, states: list[CachedRequestState],
              tokens: list[list[int]], first_rows: list[int], out: ModelRunnerOutput,
              spec: bool) -> None:
    """Logprobs of each emitted token, from the row that produced it."""
    if md.max_num_logprobs is None:
        return
    if not spec:
        lists = result.logprobs.tolists()
        for row, state in enumerate(states):
            if state.sampling_params.logprobs is not None:
                out.logprobs[state.req_id] = lists.slice(row, row + 1)
        return
    rows, chosen, spans = [], [], []
    for state, emitted, first in zip(states, tokens, first_rows):
        spans.append((len(rows), len(rows) + len(emitted)))
        rows.extend(range(first, first + len(emitted)))
        chosen.extend(emitted)
    dev = result.raw_logprobs.device
    lists = gather_logprobs(result.raw_logprobs[torch.tensor(rows, device=dev)],
                            md.max_num_logprobs,
                            torch.tensor(chosen, device=dev)).tolists()
    for state, (a, b) in zip(states, spans):
        if state.sampling_params.logprobs is not None:
            out.logprobs[state.req_id] = lists.slice(a, b)
