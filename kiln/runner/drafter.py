"""Drafters: what the runner calls after each step to propose the next step's drafts.

`propose(rows, states)` sees the step's forward rows (each request's input tokens) and
the states of the requests that just sampled (their token lists already hold what they
emitted). It returns req_id -> draft tokens; the scheduler cuts them to the budget and
the length limits.
"""
from __future__ import annotations

import logging
from typing import Protocol, Sequence

import torch

from kiln.config.compilation import CompilationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.models.model_config import ModelConfig
from kiln.runner.state import CachedRequestState, RunnerLimits, StepRow
from kiln.spec_decode.draft_length import AcceptanceStats, StepCosts, choose_lengths
from kiln.spec_decode.ngram import NgramProposer, TokenBytes

logger = logging.getLogger(__name__)



class DraftRunner(Protocol):
    """What a draft model's drafter needs of its runner (a `ModelRunner`)."""

    limits: RunnerLimits
    model: torch.nn.Module

    def forward_rows(self, rows: list[StepRow], uniform_query_len: int = 1
                     ) -> torch.Tensor: ...


class TargetRunner(Protocol):
    """What `make_drafter` reads of the target's runner (a `ModelRunner`, whose class
    also builds the draft's runner)."""

    dtype: torch.dtype
    device: torch.device
    limits: RunnerLimits
    num_kv_blocks: int


class Drafter(Protocol):
    def propose(self, rows: Sequence[StepRow], states: Sequence[CachedRequestState]
                ) -> dict[str, list[int]]: ...

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step of `num_tokens` tokens (one per request and its drafts) took
        `seconds`, from its start to the next step's (draft_length.DecodeStepTimer)."""


# Every this many steps an n-gram draft is proposed whole, whatever the costs say: the
# step costs of longer drafts are measured again (the host's load changes).
EXPLORE_EVERY = 64


class NgramDrafter:
    """Prompt lookup on each request's own tokens; costs no forward.

    Each request's draft is the lookup's continuation, cut where the tokens stop paying
    for their verification rows (draft_length: the step costs measured here, the chances
    of acceptance learned per match length). A request with a seed and random sampling
    instead keeps a rule that depends on its own tokens alone, so that its output does
    not depend on the host's timing (every request does with draft_length
    "deterministic"): after a draft was cut short at position a, the next one has at
    most a + 1 tokens; after one was taken whole, the limit doubles back towards k."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(self.k, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.by_cost = config.draft_length == "cost"
        self.costs = StepCosts()
        self.stats = AcceptanceStats(self.k)
        self._steps = 0
        self._limit: dict[str, int] = {}  # req_id -> its token rule's next limit
        self._proposed_at: dict[str, int] = {}  # req_id -> len(token_ids) at its last draft
        self._bucket: dict[str, int] = {}  # req_id -> its last draft's match-length bucket
        self._tokens: dict[str, TokenBytes] = {}  # req_id -> its tokens, for the search

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.costs.observe(num_tokens, seconds)

    def _learn(self, s: CachedRequestState) -> int:
        """Records the outcome of the request's last draft (as the scheduler cut it);
        returns the token rule's limit for its next one."""
        limit = self._limit.get(s.req_id, self.k)
        start = self._proposed_at.get(s.req_id)
        verified = len(s.spec_token_ids)
        bucket = self._bucket.get(s.req_id)
        if verified and start is not None and bucket is not None:
            # The step appended its accepted drafts and one more token (bonus or correction).
            accepted = min(verified, max(0, len(s.token_ids) - start - 1))
            self.stats.record(bucket, verified, accepted)
            limit = min(self.k, 2 * limit) if accepted >= verified else accepted + 1
        return limit

    def propose(self, rows: Sequence[StepRow], states: Sequence[CachedRequestState]
                ) -> dict[str, list[int]]:
        drafts, limits, tokens, buckets = {}, {}, {}, {}
        for s in states:
            limit = self._learn(s)
            tokens[s.req_id] = index = self._tokens.get(s.req_id) or TokenBytes()
            params = s.sampling_params
            by_tokens = not self.by_cost or (params.seed is not None and not params.is_greedy)
            if by_tokens:
                limits[s.req_id] = limit
            d, n = self.proposer.lookup(s.token_ids, limit if by_tokens else self.k, index)
            if d:
                drafts[s.req_id] = d
                buckets[s.req_id] = self.stats.bucket(n)
        self._steps += 1
        free = [rid for rid in drafts if rid not in limits]
        if free and self._steps % EXPLORE_EVERY:
            fixed = len(states) + sum(len(d) for rid, d in drafts.items() if rid in limits)
            chances = {rid: self.stats.cumulative(buckets[rid], len(drafts[rid]))
                       for rid in free}
            for rid, n in choose_lengths(chances, fixed, self.costs).items():
                drafts[rid] = drafts[rid][:n]
        # Only requests that sampled this step are kept: the others start again (and
        # rebuild their token bytes).
        self._limit, self._tokens, self._bucket = limits, tokens, buckets
        self._proposed_at = {s.req_id: len(s.token_ids) for s in states}
        return {rid: d for rid, d in drafts.items() if d}


class DraftModelDrafter:
    """A smaller model run by its own `ModelRunner` (its own weights, KV cache and
    compiled graphs, at the target's level), drafting greedily.

    Its KV cache has the target's block count and is addressed through the target's
    block tables: the draft's KV for position p sits in the same slot as the target's.
    Every step the draft first runs the target's own rows (so wherever the target has
    KV, prefix-cache hits included, the draft has it too, for the same tokens); then,
    per sampling request, it feeds the last emitted token and k - 1 of its own drafts
    one at a time. Those write up to k - 1 slots past the target's scheduled tokens,
    which is why the scheduler allocates k lookahead slots per request."""

    def __init__(self, config: SpeculativeConfig, runner: DraftRunner) -> None:
        self.k = config.num_speculative_tokens
        self.runner = runner

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pass  # drafts whole: its k - 1 forwards cost the same whatever is accepted

    @torch.inference_mode()
    def propose(self, rows: Sequence[StepRow], states: Sequence[CachedRequestState]
                ) -> dict[str, list[int]]:
        r = self.runner
        r.forward_rows(list(rows))
        bs, max_len = r.limits.block_size, r.limits.max_model_len
        cur = [(s, StepRow([s.token_ids[-1]], len(s.token_ids) - 1, s.block_ids))
               for s in states]
        drafts: dict[str, list[int]] = {s.req_id: [] for s in states}
        for _ in range(self.k):
            # A position past the model's length or the allocated blocks is not drafted.
            cur = [(s, row) for s, row in cur
                   if row.start < min(max_len, len(row.block_ids[0]) * bs)]
            if not cur:
                break
            hidden = r.forward_rows([row for _, row in cur])
            logits = r.model.compute_logits(hidden[: len(cur)])  # one token per row
            tokens = logits.argmax(dim=-1).tolist()
            nxt = []
            for (s, row), t in zip(cur, tokens):
                drafts[s.req_id].append(t)
                nxt.append((s, StepRow([t], row.start + 1, row.block_ids)))
            cur = nxt
        return {rid: d for rid, d in drafts.items() if d}


def make_drafter(config: SpeculativeConfig, target: TargetRunner,
                 draft_config: ModelConfig | None, compilation: CompilationConfig | None,
                 attention_backend: str | None, progress: bool) -> Drafter:
    """The proposer: n-gram lookup, or a draft model in a runner of its own whose KV cache
    matches the target's blocks one for one (it reads the target's block tables)."""
    if config.method == "ngram":
        return NgramDrafter(config)
    runner = type(target)(draft_config, target.dtype, target.device, target.limits,
                          num_kv_blocks=target.num_kv_blocks,
                          attention_backend=attention_backend, compilation=compilation,
                          progress=progress)
    logger.info("draft model %s ready (%d KV blocks, its own compiled graphs)",
                draft_config.architecture, runner.num_kv_blocks)
    return DraftModelDrafter(config, runner)
