"""Turns what the scheduler and runner produced in one step into `RequestOutput`s.

Every user request is a `RequestGroup` of n samples; each sample is its own scheduler
request (id = the user's id when n == 1, else "<index>_<id>"), so the samples share the
prompt's KV blocks through the prefix cache rather than copying them. Per sample it
detokenizes incrementally, checks stop strings, assembles logprobs, and shapes the output
by `output_kind`: CUMULATIVE (everything so far), DELTA (only what is new) or FINAL_ONLY.
At most one output per user request per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.output_text import OutputText
from kiln.engine.outputs import CompletionOutput, RequestOutput
from kiln.sampling.logprobs import LogprobsLists, PositionLogprobs, to_position_dicts
from kiln.sampling.params import RequestOutputKind, SamplingParams
from kiln.scheduler.output import ModelRunnerOutput
from kiln.scheduler.step import EngineCoreOutput

Namer = Callable[[list[int]], list[str]] | None


@dataclass(slots=True)
class SampleState:
    req_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0  # tokens (and logprob rows) already reported, for DELTA
    updated: bool = False  # got tokens this step
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: list[SampleState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Any, namer: Namer) -> None:
        self.tokenizer = tokenizer
        self.namer = namer
        self.groups: dict[str, RequestGroup] = {}
        self.sample_to_group: dict[str, RequestGroup] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Register a user request; return (scheduler request id, params) per sample."""
        children = [(rid, params if params.n == 1 else params.for_child(i))
                    for i, rid in enumerate(sample_ids(request_id, params.n))]
        samples = []
        for i, (rid, p) in enumerate(children):
            if i > 0 and p.prompt_logprobs is not None:
                # Only sample 0 computes prompt logprobs; the others then hit its cached
                # prompt blocks instead of recomputing them.
                children[i] = (rid, p := _without_prompt_logprobs(p))
            samples.append(SampleState(
                rid, i, p, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                  p.skip_special_tokens),
                OutputText(p), logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None))
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), params.output_kind,
                             samples)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        self.groups[request_id] = group
        for s in samples:
            self.sample_to_group[s.req_id] = group
        return children

    def sample_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [s.req_id for s in group.samples] if group else []

    def remove(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        for s in group.samples if group else []:
            self.sample_to_group.pop(s.req_id, None)

    def process(self, core_outputs: list[EngineCoreOutput], runner_out: ModelRunnerOutput
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs and the scheduler ids of samples a stop string finished
        (the engine tells the scheduler, which frees their blocks)."""
        touched: dict[str, RequestGroup] = {}
        for rid, (start, rows) in runner_out.prompt_logprobs.items():
            group = self.sample_to_group.get(rid)
            if group is not None and group.prompt_logprobs is not None:
                self._store_prompt_logprobs(group, start, rows)
        stopped: list[str] = []
        for core in core_outputs:
            group = self.sample_to_group.get(core.req_id)
            if group is None:
                continue
            sample = group.samples[0] if len(group.samples) == 1 else next(
                s for s in group.samples if s.req_id == core.req_id)
            if self._update_sample(sample, core, runner_out.logprobs.get(core.req_id)):
                stopped.append(core.req_id)
            group.first_token_time = group.first_token_time or time.monotonic()
            touched[group.request_id] = group
        outputs = []
        for group in touched.values():
            out = self._make_output(group)
            if out is not None:
                outputs.append(out)
            if group.finished:
                self.remove(group.request_id)
        return outputs, stopped

    # ---- one sample ------------------------------------------------------------------------
    def _update_sample(self, s: SampleState, core: EngineCoreOutput,
                       logprobs: LogprobsLists | None) -> bool:
        """Take a step's tokens one at a time (a speculative step brings several): a stop
        string ends the output at the token that completes it, and the tokens after it
        (and their logprobs) are dropped."""
        s.updated = True
        entries = None
        if s.logprobs is not None and logprobs is not None:
            entries = to_position_dicts(logprobs, s.params.logprobs, self.namer)
        s.finish_reason, s.stop_reason = core.finish_reason, core.stop_reason
        ids, last = core.new_token_ids, len(core.new_token_ids) - 1
        # A stop token id ends the step and is not part of the text.
        hide_last = core.finish_reason == "stop" and core.stop_reason is not None \
            and not s.params.include_stop_str_in_output
        for i, token in enumerate(ids):
            s.token_ids.append(token)
            if entries is not None:
                s.logprobs.append(entries[i])
                s.cumulative_logprob += entries[i][token].logprob
            text = s.detokenizer.update([] if i == last and hide_last else [token])
            stop = s.text.append(text, len(s.token_ids))
            if stop is not None and (core.finish_reason is None or i < last):
                s.finish_reason, s.stop_reason = "stop", stop
                return True
        return False

    def _store_prompt_logprobs(self, group: RequestGroup, start: int,
                               rows: LogprobsLists) -> None:
        k = group.samples[0].params.prompt_logprobs or 0
        entries = to_position_dicts(rows, k, self.namer)
        group.prompt_logprobs[start: start + len(entries)] = entries

    # ---- shaping ---------------------------------------------------------------------------
    def _make_output(self, group: RequestGroup) -> RequestOutput | None:
        kind, finished = group.output_kind, group.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [c for s in group.samples
                       if (c := self._completion(s, delta)) is not None]
        prompt_lp = group.prompt_logprobs
        if delta and group.prompt_logprobs_sent:
            prompt_lp = None
        group.prompt_logprobs_sent = True
        # A sample that failed alone (its grammar, its adapter) carries the message.
        error = next((s.stop_reason for s in group.samples if s.finish_reason == "error"),
                     None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             completions, finished, prompt_logprobs=prompt_lp,
                             error=error if isinstance(error, str) else None,
                             metrics={"arrival_time": group.arrival_time,
                                      "first_token_time": group.first_token_time})

    @staticmethod
    def _completion(s: SampleState, delta: bool) -> CompletionOutput | None:
        finished = s.finish_reason is not None
        updated, s.updated = s.updated, False
        if not delta:
            return CompletionOutput(s.index, s.text.next_text(finished, False),
                                    list(s.token_ids), s.cumulative_logprob,
                                    list(s.logprobs) if s.logprobs is not None else None,
                                    s.finish_reason, s.stop_reason)
        if not updated:
            return None  # nothing new for this sample in this step
        start, s.sent_tokens = s.sent_tokens, len(s.token_ids)
        return CompletionOutput(s.index, s.text.next_text(finished, True),
                                s.token_ids[start:], s.cumulative_logprob,
                                s.logprobs[start:] if s.logprobs is not None else None,
                                s.finish_reason, s.stop_reason)


def sample_ids(request_id: str, n: int) -> list[str]:
    """Scheduler ids of a user request's samples: its own id when n == 1."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def _without_prompt_logprobs(params: SamplingParams) -> SamplingParams:
    return replace(params, prompt_logprobs=None)
