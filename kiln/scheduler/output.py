"""SchedulerOutput: the only thing that crosses from the scheduler to the runner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kiln.lora.request import LoRARequest
from kiln.sampling.logprobs import LogprobsLists
from kiln.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kiln.kv_transfer.base import KVConnectorMetadata


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must forget and recompute: resumed after
    preemption). `token_ids` is every token known so far: prompt plus outputs."""

    req_id: str
    token_ids: list[int]
    block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]  # banned while the output is shorter than min_tokens
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request already in the runner: the blocks it gained this step. Under pipeline
    parallelism also the tokens it computes this step (from `num_computed_tokens` on):
    only the last stage samples, so the others learn the sampled tokens here."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int
    token_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order (running first, then new).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop before this step (finished, aborted or preempted).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: [rows, ceil(V/32)] int32 allowed-token bits, and the row of each
    # constrained request that samples this step (None / empty without any).
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: req_id -> the draft tokens scheduled after its real tokens
    # (counted in num_scheduled_tokens); absent for requests without drafts this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV connector: the blocks to load before this step's forward and to save after it.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request; [] for a prefill chunk that is not the last."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> logprobs of this step's sampled token(s), for requests that asked.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> (first prompt position covered, rows): prompt logprobs of this chunk.
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for its next step (speculative decoding only).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV connector: the worker side's counters for this step (blocks saved, failures).
    kv_connector_stats: dict[str, float] | None = None
    # LoRA adapters the worker could not load this step: lora_int_id -> why. Their rows
    # ran on the base model; the engine fails their requests.
    failed_loras: dict[int, str] = field(default_factory=dict)
