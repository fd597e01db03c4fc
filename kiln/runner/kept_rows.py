"""The rows a step reads, and the last decoder layer computing only those after its
attention.

A prefill step of one 2,000-token prompt samples from one hidden row, yet every layer
computes all 2,000; in the last layer nothing reads the other rows' attention output,
o_proj or MLP (the KV cache takes K and V, which come before). So the runner names the
rows it will read (`logits_indices`) in a per-step buffer the last layer's output linears
take as their kept-rows hint (csrc/kept_rows.h: the others come back zero), and tells the
attention backend how many trailing query rows of each request that layer needs
(`AttentionMetadata.query_keep`). The hint is a buffer input, so the compiled graph is the
same for every step; the other layers' linears hold a constant "every row" buffer of the
same shape, so every layer still traces to one compiled region.

Every row is computed (the hint says -1) when a step reads more than the sampled rows:
prompt logprobs read every prompt row. A pipeline stage before the last hands all rows on,
so only the last stage installs the hint; a draft model's runner never sets it (its
forward_rows callers read every row). Nothing changes where the kernels that would honour
it do not run (fp32, CUDA): they compute every row, which is always correct.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from kiln.runner.state import CachedRequestState, StepRow
from kiln.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class StepRows:
    rows: list[StepRow]  # each request's inputs: its real tokens, then its drafts
    logits_indices: list[int]  # the hidden rows whose logits are needed, ascending
    sample_ids: list[str]  # the requests that sample
    keep: list[int]  # per request, its trailing rows among logits_indices (0: none)


def step_rows(requests: dict[str, CachedRequestState], req_ids: list[str],
              so: SchedulerOutput, lora_slots: list[int] | None) -> StepRows:
    """The step's inputs and the rows it reads: a request that samples (its last real
    token completes what it has) needs the logits of that token and of every draft after
    it; a prefill chunk that stops short of its prompt needs none."""
    spec = so.scheduled_spec_decode_tokens
    step = StepRows([], [], [], [])
    offset = 0
    for i, rid in enumerate(req_ids):
        state, n = requests[rid], so.num_scheduled_tokens[rid]
        drafts = spec.get(rid, [])
        start = state.num_computed_tokens
        real_end = start + n - len(drafts)
        tokens = state.token_ids[start:real_end]
        step.rows.append(StepRow(tokens + drafts if drafts else tokens, start,
                                 state.block_ids, -1 if lora_slots is None else lora_slots[i]))
        offset += n
        state.spec_token_ids = drafts
        samples = real_end >= len(state.token_ids)
        step.keep.append(1 + len(drafts) if samples else 0)
        if samples:
            step.logits_indices.extend(range(offset - 1 - len(drafts), offset))
            step.sample_ids.append(rid)
    return step


class KeptRows:
    """The hint's buffer (`[1 + max tokens]` int64: the count, then the rows; -1: every
    row) and the step's choice."""

    def __init__(self, model: nn.Module, max_tokens: int, device: torch.device) -> None:
        self.buffer = torch.full((1 + max_tokens,), -1, dtype=torch.int64)
        self.keep_layer = -1  # the last attention layer, counted as the runner's caches
        per_layer = getattr(model, "linears_after_attention", None)
        stage = getattr(model, "stage", None)
        layers = per_layer() if per_layer is not None and device.type == "cpu" else []
        self.enabled = bool(layers) and (stage is None or stage.last)
        if not self.enabled:
            return
        every = torch.full_like(self.buffer, -1)  # read by every layer but the last
        for i, linears in enumerate(layers):
            for linear in linears:
                linear.kept_rows = self.buffer if i == len(layers) - 1 else every
        self.keep_layer = len(model.attention_layers()) - 1

    @contextmanager
    def reading(self, states: Sequence[CachedRequestState], step: StepRows,
                num_tokens: int) -> Iterator[list[int] | None]:
        """Around the step's forward: yields `step.keep` when the last layer may compute
        only those rows (the buffer names them until the forward ends), else None: every
        row."""
        n = len(step.logits_indices)
        if (not self.enabled or n >= num_tokens
                or any(s.sampling_params.prompt_logprobs is not None for s in states)):
            yield None
            return
        self.buffer[0] = n
        self.buffer[1: n + 1] = torch.as_tensor(step.logits_indices, dtype=torch.int64)
        try:
            yield step.keep
        finally:
            self.buffer[0] = -1
