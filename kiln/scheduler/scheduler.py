"""The unified scheduler: no prefill/decode phases, one token budget per step.

Each step every request's `num_computed_tokens` catches up with its `num_tokens` as far as
the budget allows: running requests first (decodes and unfinished prefill chunks), then
waiting ones (chunked prefill when the budget runs short). When blocks run out, the last
running request is preempted (FCFS victim) and will be recomputed from scratch.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kiln.engine.request import Request, RequestStatus
from kiln.scheduler.kv_cache_manager import KVCacheManager
from kiln.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the runner next step
        self.num_preemptions = 0

    # ---- bookkeeping -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None:
        """Finish (e.g. abort) requests in any state; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = self._allocate_or_preempt(request, num_new, preempted)
            if new_blocks is None:  # the request itself was preempted
                break
            cached.append(CachedRequestData(request.request_id,
                                            [b.block_id for b in new_blocks],
                                            request.num_computed_tokens))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        # Admitting new work in a step that had to preempt would only thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv.allocate_slots(request, num_new) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            new.append(NewRequestData(request.request_id, list(request.all_token_ids),
                                      self.kv.get_block_ids(request.request_id),
                                      request.num_computed_tokens, request.sampling_params))
            num_scheduled[request.request_id] = num_new
            budget -= num_new

        out = SchedulerOutput(new, cached, num_scheduled, sum(num_scheduled.values()),
                              self._finished_ids, preempted)
        self._finished_ids = set()
        for rid, n in num_scheduled.items():  # progress is booked when scheduled
            self.requests[rid].num_computed_tokens += n
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             preempted: set[str]):
        while True:
            blocks = self.kv.allocate_slots(request, num_new)
            if blocks is not None:
                return blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (recompute)", request.request_id)

    # ---- results -----------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for rid, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or not token_ids:
                continue  # aborted meanwhile, or a prefill chunk that samples nothing
            new_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_ids.append(token_id)
                if self._check_stop(request):
                    break
            outputs.append(EngineCoreOutput(rid, new_ids, request.status.finish_reason,
                                            request.stop_reason))
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        params, last = request.sampling_params, request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
        elif (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
              or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH
        return request.is_finished
