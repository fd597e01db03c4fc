"""Output objects with vLLM's names, so code written for vLLM reads them unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.sampling.logprobs import PositionLogprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop", "length", "abort", or "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # One entry per prompt token (the first is None: nothing predicts it), when asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # kiln extension: why the request was rejected (it failed alone; others carried on).
    error: str | None = None
    metrics: dict = field(default_factory=dict)
