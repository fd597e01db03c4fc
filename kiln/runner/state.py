"""What the runner keeps per request and per forward row, and the limits it is sized by:
plain data shared by the runner, its sampling step and the drafters."""
from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import torch

from kiln.lora.request import LoRARequest
from kiln.sampling.params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    lora_request: LoRARequest | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step


def adapter_blocks(states: Iterable[CachedRequestState], lora_ids: Container[int]
                   ) -> set[int]:
    """The block ids of the requests that run one of these adapters."""
    return {b for st in states if st.lora_request is not None
            and st.lora_request.lora_int_id in lora_ids
            for group in st.block_ids for b in group}


@dataclass(slots=True)
class StepRow:
    """One request's share of a forward: its input tokens this step, the first one at
    position `start`, with the blocks that hold its KV."""

    token_ids: list[int]
    start: int
    block_ids: list[list[int]]  # per KV-cache group
    lora_slot: int = -1  # -1: the base model


@dataclass(slots=True)
class RunnerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
