"""What the scheduler hands out besides SchedulerOutput: per-request results, its policy
and statistics, and the bookkeeping of one `schedule()` call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.request import Request, RequestStatus
from kiln.scheduler.output import CachedRequestData, NewRequestData

if TYPE_CHECKING:
    from kiln.kv_transfer.stats import KVTransferStats
    from kiln.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class SchedulerPolicy:
    policy: str = "fcfs"  # "fcfs" | "priority" (lower value first)
    long_prefill_token_threshold: int = 0  # 0: off; else max prefill tokens per request-step
    full_sequence_must_fit: bool = False  # admit only if prompt + max_tokens fit now
    watermark: float = 0.01  # keep this fraction of blocks free when admitting


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None  # None: speculation is off
    kv_transfer: KVTransferStats | None = None  # None: no KV connector

    @property
    def num_running_reqs(self) -> int:  # vLLM's name
        return self.num_running

    @property
    def num_waiting_reqs(self) -> int:  # vLLM's name
        return self.num_waiting

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0


class StepPlan:
    """What one `schedule()` call has decided so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: dict[str, int] = {}  # req_id -> tokens, in batch order
        self.cached: dict[str, CachedRequestData] = {}
        self.new: list[NewRequestData] = []
        self.preempted: set[str] = set()
        self.spec: dict[str, list[int]] = {}  # req_id -> draft tokens verified this step

    def take(self, req_id: str, num_tokens: int) -> None:
        self.scheduled[req_id] = num_tokens
        self.budget -= num_tokens

    def refund(self, req_id: str) -> None:
        """A victim scheduled earlier in this step gives its tokens back."""
        self.budget += self.scheduled.pop(req_id, 0)
        self.cached.pop(req_id, None)
        self.spec.pop(req_id, None)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether the token just appended finishes `request` (its status and stop reason
    are set if so)."""
    params, last = request.sampling_params, request.output_token_ids[-1]
    short = request.num_output_tokens < params.min_tokens  # the sampler bans stops then
    if short and request.num_tokens < max_model_len:
        return False
    if not params.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
    elif last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
    elif (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
          or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH
    return request.is_finished
