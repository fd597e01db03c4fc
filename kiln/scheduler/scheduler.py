"""The unified scheduler: no prefill/decode phases, one token budget per step.

Each step every request's `num_computed_tokens` catches up with its `num_tokens` as far as
the budget allows: running requests first (decodes and unfinished prefill chunks), then
waiting ones, which start from their longest prefix-cache hit (chunked prefill when the
budget runs short). When blocks run out a running request is preempted and later
recomputed: the last one under FCFS, the lowest-priority one under the priority policy.
"""
from __future__ import annotations

import bisect
import logging
import time
from concurrent import futures
from typing import TYPE_CHECKING

from kiln.kv_cache.kv_cache_manager import BlockLists, KVCacheManager
from kiln.request import Request, RequestStatus
from kiln.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                   SchedulerOutput)
from kiln.scheduler.step import (EngineCoreOutput, SchedulerPolicy, SchedulerStats, StepPlan,
                                 check_stop)

if TYPE_CHECKING:  # xgrammar is imported only by engines that serve a constraint
    from kiln.kv_transfer.base import KVConnector
    from kiln.spec_decode.metrics import SpecDecodingStats
    from kiln.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 policy: SchedulerPolicy | None = None, max_loras: int = 0,
                 spec_stats: SpecDecodingStats | None = None,
                 num_lookahead_tokens: int = 0,
                 kv_connector: KVConnector | None = None) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy or SchedulerPolicy()
        self.max_loras = max_loras  # distinct adapters per step (the runner's slots)
        # Speculative decoding: acceptance counters (None: off), and the KV slots past a
        # request's scheduled tokens that a draft model writes when it proposes.
        self.spec_stats = spec_stats
        self.num_lookahead_tokens = num_lookahead_tokens
        # The scheduler side of a KV connector: external prefix hits and what to save.
        self.connector = kv_connector
        # Set by the engine on the first constrained request.
        self.structured: StructuredOutputManager | None = None
        self.errors: dict[str, str] = {}  # req_id -> why it failed alone (taken by the engine)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in admission order for the policy
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the runner next step
        # Pipeline parallelism: steps scheduled whose output is not back yet, per request
        # (a request in flight is neither preempted nor given more tokens than it has),
        # and the pipeline's stages, one step in flight each (set by the engine). With
        # more than one, each step takes at most 1/depth of the running requests, so the
        # next step has others to run (all in one step would leave nothing to schedule
        # until it returns: the stages would take turns), and the runners learn each
        # step's tokens from here (the stages before the last never sample).
        self._in_flight: dict[str, int] = {}
        self.pipeline_depth = 1
        self._arrivals = 0
        self._order: dict[str, tuple] = {}
        self.num_preemptions = 0

    # ---- bookkeeping -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._arrivals += 1
        key = (request.priority, self._arrivals) if self.policy.policy == "priority" \
            else (self._arrivals,)
        self._order[request.request_id] = key
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [self._order[r.request_id] for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._order[request.request_id]), request)

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

    def fail_requests(self, request_ids: list[str], message: str) -> None:
        """Finish requests with an error that reaches their callers (`take_errors`). Their
        KV may be wrong (it ran without their adapter): the blocks only they hold leave
        the prefix cache as they are freed."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self.kv.uncache(request)
                if self.connector is not None:  # the worker dropped their saves
                    self.connector.forget_saves(request.block_hashes)
        self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        self.errors.update(dict.fromkeys(request_ids, message))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def make_stats(self) -> SchedulerStats:
        s = self.kv.stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, s.queries,
                              s.hits, self.num_preemptions,
                              self.spec_stats.snapshot() if self.spec_stats else None,
                              self.connector.stats.snapshot() if self.connector else None)

    def idle_wait(self, timeout_s: float) -> None:
        """Nothing could be scheduled: block until a waiting request's grammar compile
        finishes (or the timeout), or nap briefly while requests wait for KV that another
        instance publishes (never a busy loop against the work being waited for)."""
        pending = [r.structured.future for r in self.waiting
                   if r.structured is not None and r.structured.matcher is None]
        if pending:
            futures.wait(pending, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)
        elif self.connector is not None and self.connector.is_waiting_for_remote():
            time.sleep(min(timeout_s, 0.005))

    def take_errors(self) -> list[EngineCoreOutput]:
        """Requests that failed alone since the last call, as final outputs."""
        errors, self.errors = self.errors, {}
        return [EngineCoreOutput(rid, [], "error", msg) for rid, msg in errors.items()]

    def _free(self, request: Request) -> None:
        if self.connector is not None:  # its saves copy blocks out: nothing to defer
            self.connector.request_finished(request)
        self.kv.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        del self._order[request.request_id]

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = StepPlan(self.max_num_batched_tokens)
        share = -(-len(self.running) // self.pipeline_depth)  # ceil: at least one
        for request in list(self.running):
            if step.budget <= 0 or len(step.cached) >= share:
                break
            if request.request_id in step.preempted:
                continue
            real = request.num_tokens - request.num_computed_tokens
            spec = self._usable_drafts(request)
            if real + len(spec) == 0:
                continue  # its last step is still in flight (pipeline parallelism)
            num_new = self._chunk(real + len(spec), step)
            spec = spec[: max(0, num_new - real)]  # a short budget verifies fewer drafts
            new_blocks = self._allocate_or_preempt(request, num_new, step)
            if new_blocks is None:  # preempted itself, or waits for a step in flight
                continue
            done = request.num_computed_tokens
            step.cached[request.request_id] = CachedRequestData(
                request.request_id, tuple([b.block_id for b in g] for g in new_blocks), done,
                request.all_token_ids[done: done + num_new] if self.pipeline_depth > 1
                else None)
            step.take(request.request_id, num_new)
            if spec:
                step.spec[request.request_id] = spec

        if not step.preempted:  # admitting new work then would only thrash
            self._admit_waiting(step)

        out = SchedulerOutput(step.new, list(step.cached.values()), step.scheduled,
                              sum(step.scheduled.values()), self._finished_ids, step.preempted,
                              scheduled_spec_decode_tokens=step.spec)
        self._finished_ids = set()
        for rid, n in step.scheduled.items():  # progress is booked when scheduled;
            request = self.requests[rid]  # rejected drafts are rolled back on the output
            request.num_computed_tokens += n
            request.spec_token_ids = []
            if self.pipeline_depth > 1:  # one step at a time: nothing is ever in flight
                self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._grammar_bitmask(out)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(
                [(self.requests[rid], self.kv.req_to_blocks[rid]) for rid in step.scheduled])
        return out

    def _lookahead(self, num_tokens: int) -> int:
        """Lookahead slots past `num_tokens` (a draft model's writes), never past
        max_model_len: start-up checked that a request of that length fits the cache, so
        a request alone can always be scheduled."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens))

    def _usable_drafts(self, request: Request) -> list[int]:
        """The request's drafts, cut so that verified tokens never pass max_model_len
        nor max_tokens (the bonus token counts too)."""
        spec = request.spec_token_ids
        if not spec:
            return spec
        room = self.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return spec[: max(0, room)]

    def _grammar_bitmask(self, out: SchedulerOutput) -> None:
        """One bitmask row per constrained request that samples this step."""
        if self.structured is None:
            return
        rows = [self.requests[rid] for rid in out.num_scheduled_tokens]
        rows = [r for r in rows if r.structured is not None
                and r.num_computed_tokens >= r.num_tokens]
        if rows:
            out.grammar_bitmask = self.structured.bitmask([r.structured for r in rows])
            out.structured_output_request_ids = {r.request_id: i for i, r in enumerate(rows)}

    def _admit_waiting(self, step: StepPlan) -> None:
        """Admit in policy order while budget, sequences and blocks last. A request whose
        adapter would exceed the LoRA slots (every running adapter stays in its slot) is
        passed over, not a barrier: the requests behind it may run meanwhile."""
        adapters = {r.lora_int_id for r in self.running} - {0}
        for request in list(self.waiting):
            if step.budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not self._grammar_ready(request):
                continue  # still compiling (or just failed): the rest may run meanwhile
            lid = request.lora_int_id
            if lid and lid not in adapters and len(adapters) >= self.max_loras:
                continue
            admitted = self._admit(request, step)
            if admitted is None:
                continue  # its KV is still on the way from another instance
            if not admitted:
                return
            if lid:
                adapters.add(lid)

    def _grammar_ready(self, request: Request) -> bool:
        so = request.structured
        if so is None or self.structured is None or self.structured.is_ready(so):
            return True
        if so.error is not None:
            self.errors[request.request_id] = so.error
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        return False

    def _chunk(self, num_new: int, step: StepPlan) -> int:
        threshold = self.policy.long_prefill_token_threshold
        if threshold and self.get_num_unfinished_requests() > 1:
            num_new = min(num_new, threshold)  # alone, a request may take the whole budget
        return min(num_new, step.budget)

    def _admit(self, request: Request, step: StepPlan) -> bool | None:
        """Admit `request` if its blocks fit: True; False stops admission this step;
        None passes over it (its KV is still arriving from another instance)."""
        computed = self.kv.empty()
        num_computed = request.num_computed_tokens
        num_external = 0  # tokens a KV connector loads right after the local hit
        if num_computed == 0:
            computed, num_computed = self.kv.get_computed_blocks(request)
            if self.connector is not None:
                num_external = self.connector.get_num_new_matched_tokens(request,
                                                                         num_computed)
                if num_external is None:
                    return None
        num_new = self._chunk(request.num_tokens - num_computed - num_external, step)
        done = num_computed + num_external
        if not self._fits(request, done + num_new, computed):
            return False
        new_blocks = self.kv.allocate_slots(request, num_new, computed,
                                            self._lookahead(done + num_new), num_external)
        if new_blocks is None:
            return False
        if num_external:
            self.connector.update_state_after_alloc(
                request, [b.block_id
                          for b in new_blocks[0][: num_external // self.kv.block_size]])
        if request.num_computed_tokens == 0:
            self.kv.record_lookup(request.num_tokens, num_computed)
        num_computed = done
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        step.new.append(NewRequestData(request.request_id, list(request.all_token_ids),
                                       self.kv.get_block_ids(request.request_id),
                                       num_computed, request.sampling_params,
                                       request.num_prompt_tokens, request.eos_token_ids,
                                       request.lora_request))
        step.take(request.request_id, num_new)
        return True

    def _fits(self, request: Request, num_tokens: int, hits: BlockLists) -> bool:
        """Admission checks beyond "the blocks for this step exist" (which allocate_slots
        makes). With nothing running every request must be admissible, or it would wait
        forever: start-up checked that max_model_len fits the whole cache."""
        if not self.running:
            return True
        pool = self.kv.block_pool
        if self.policy.full_sequence_must_fit:
            max_tokens = request.sampling_params.max_tokens or self.max_model_len
            num_tokens = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        needed = self.kv.num_blocks_for(num_tokens, self.max_num_batched_tokens) \
            - sum(not b.is_null for group in hits for b in group)
        reserve = int(self.policy.watermark * (pool.num_blocks - 1))
        return pool.get_num_free_blocks() - needed >= reserve

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             step: StepPlan) -> BlockLists | None:
        while True:
            blocks = self.kv.allocate_slots(request, num_new,
                                            num_lookahead=self._lookahead(
                                                request.num_computed_tokens + num_new))
            if blocks is not None:
                return blocks
            victim = self._pick_victim()
            if victim is None:  # every other candidate is in flight: this one waits
                return None
            self.running.remove(victim)
            self._preempt(victim)
            step.preempted.add(victim.request_id)
            step.refund(victim.request_id)
            if victim is request:
                return None

    def _pick_victim(self) -> Request | None:
        """The request to preempt; never one in flight (its step still writes its KV, and
        its output would land on a request that restarted)."""
        candidates = [r for r in self.running if r.request_id not in self._in_flight] \
            if self._in_flight else self.running
        if not candidates:
            return None
        if self.policy.policy == "priority":
            return max(candidates, key=lambda r: self._order[r.request_id])
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy.policy == "priority":
            self._enqueue(request)
        else:
            self.waiting.insert(0, request)
        logger.debug("preempted %s (recompute)", request.request_id)

    # ---- results -----------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.num_scheduled_tokens if self._in_flight else ():
            left = self._in_flight.pop(rid, 1) - 1
            if left:
                self._in_flight[rid] = left
        if self.connector is not None:
            self.connector.update_connector_output(runner_output.kv_connector_stats)
        for rid, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or not token_ids:
                continue  # aborted meanwhile, or a prefill chunk that samples nothing
            if rid in spec:  # rejected drafts: their KV slots are rewritten later
                request.num_computed_tokens -= len(spec[rid]) + 1 - len(token_ids)
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(spec[rid]), len(token_ids) - 1)
            new_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_ids.append(token_id)
                if request.structured is not None:
                    request.structured.accept(token_id)
                if check_stop(request, self.max_model_len):
                    break
            outputs.append(EngineCoreOutput(rid, new_ids, request.status.finish_reason,
                                            request.stop_reason))
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
            elif request.structured is None:  # constrained requests are not drafted for
                request.spec_token_ids = runner_output.spec_token_ids.get(rid, [])
        return outputs
