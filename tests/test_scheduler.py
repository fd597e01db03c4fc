"""Scheduler behaviour and invariants, driven without a model: a fake runner output
samples a fixed token for every request that reached the end of its known tokens."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from kiln.kv_cache.block_hash import BlockHasher
from kiln.kv_cache.kv_cache_manager import KVCacheManager
from kiln.kv_cache.kv_cache_spec import FullAttentionSpec
from kiln.request import Request, RequestStatus
from kiln.sampling.params import SamplingParams
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kiln.scheduler.scheduler import Scheduler
from kiln.scheduler.step import SchedulerPolicy

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)


HASHER = BlockHasher(SPEC.block_size)


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, max_len=64, caching=False,
                   **policy) -> Scheduler:
    return Scheduler(KVCacheManager(SPEC, num_blocks, enable_caching=caching),
                     max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_len, policy=SchedulerPolicy(**policy))


def req(rid: str, n_prompt: int, max_tokens: int = 4, eos=(2,), priority: int = 0,
        tokens: list[int] | None = None) -> Request:
    return Request(rid, tokens or [5] * n_prompt,
                   SamplingParams(temperature=0, max_tokens=max_tokens), eos,
                   priority=priority, block_hasher=HASHER)


def fake_run(sched: Scheduler, so: SchedulerOutput, token: int = 7):
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = sched.requests[rid]
        ids.append(rid)
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    return sched.update_from_output(so, ModelRunnerOutput(ids, sampled))


def check_invariants(sched: Scheduler) -> None:
    pool = sched.kv.block_pool
    holders: dict[int, int] = {}
    for blocks in sched.kv.req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free = {b.block_id for b in pool.free_queue}
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0)
        assert (b.block_id in free) == (b.ref_cnt == 0)
    assert len(free) + len(holders) == pool.num_blocks - 1
    assert set(sched.kv.req_to_blocks) <= {r.request_id for r in sched.running}


def test_running_first_then_waiting_within_budget():
    s = make_scheduler(budget=10)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 6, "b": 4}  # b's prefill is chunked
    fake_run(s, so)
    so = s.schedule()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 2)]


def test_stop_on_eos_and_length():
    s = make_scheduler()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("len", 3, max_tokens=2, eos=()))
    outs = fake_run(s, s.schedule(), token=2)
    reasons = {o.req_id: o.finish_reason for o in outs}
    assert reasons == {"eos": "stop", "len": None}
    outs = fake_run(s, s.schedule())
    assert outs[0].finish_reason == "length"
    assert not s.has_unfinished_requests()
    assert s.kv.block_pool.get_num_free_blocks() == 63


def test_preemption_takes_the_last_running_request():
    s = make_scheduler(num_blocks=5, budget=64)  # 4 usable blocks = 16 tokens
    s.add_request(req("first", 8, max_tokens=20))
    s.add_request(req("second", 8, max_tokens=20))
    fake_run(s, s.schedule())  # both prompts fill 2 blocks each
    so = s.schedule()  # 'first' needs a third block: 'second' is the victim
    assert so.preempted_req_ids == {"second"}
    assert list(so.num_scheduled_tokens) == ["first"]
    victim = s.waiting[0]
    assert victim.request_id == "second" and victim.num_computed_tokens == 0
    assert victim.status is RequestStatus.PREEMPTED
    check_invariants(s)


def test_abort_from_any_state_frees_everything():
    s = make_scheduler(budget=8)
    for i in range(4):
        s.add_request(req(str(i), 6))
    fake_run(s, s.schedule())
    s.finish_requests(["0", "3", "unknown"], RequestStatus.FINISHED_ABORTED)
    check_invariants(s)
    so = s.schedule()
    assert {"0", "3"} <= so.finished_req_ids
    s.finish_requests(["1", "2"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.block_pool.get_num_free_blocks() == 63


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 2))
    assert len(s.schedule().num_scheduled_tokens) == 2


def test_priority_victim_is_lowest_priority_and_its_budget_is_refunded():
    s = make_scheduler(num_blocks=6, budget=64, policy="priority")  # 5 usable blocks
    s.add_request(req("low", 8, max_tokens=20, priority=5))
    fake_run(s, s.schedule())  # low: 2 blocks, running
    s.add_request(req("high", 8, max_tokens=20, priority=0))
    fake_run(s, s.schedule())  # low decodes (3 blocks), high is admitted (2): pool full
    so = s.schedule()  # low fits in its block; high needs a new one
    # 'low' was scheduled first this step, then 'high' ran out: 'low' is the victim (not
    # the last-running one) and gives its tokens back.
    assert so.preempted_req_ids == {"low"}
    assert list(so.num_scheduled_tokens) == ["high"]
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["high"]
    check_invariants(s)


def test_long_prefill_threshold_splits_prompts_when_others_wait():
    s = make_scheduler(budget=64, long_prefill_token_threshold=4)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10))
    assert s.schedule().num_scheduled_tokens == {"a": 4, "b": 4}
    alone = make_scheduler(budget=64, long_prefill_token_threshold=4)
    alone.add_request(req("a", 10))
    assert alone.schedule().num_scheduled_tokens == {"a": 10}  # alone: no cap


def test_full_sequence_must_fit_holds_back_admission():
    for must_fit, admitted in ((False, {"a", "b"}), (True, {"a"})):
        s = make_scheduler(num_blocks=11, budget=64, max_len=40,
                           full_sequence_must_fit=must_fit)
        s.add_request(req("a", 4, max_tokens=4))
        fake_run(s, s.schedule())
        s.add_request(req("b", 4, max_tokens=36))  # 40 tokens = 10 blocks: not free now
        assert set(s.schedule().num_scheduled_tokens) == admitted


def test_prefix_hits_skip_computed_tokens_capped_below_the_last():
    s = make_scheduler(budget=64, caching=True)
    s.add_request(req("first", 12, tokens=list(range(10, 22))))
    fake_run(s, s.schedule())
    # Same 12 tokens: 3 full blocks cached, but the last token must be computed.
    s.add_request(req("same", 12, tokens=list(range(10, 22))))
    # Shares 2 blocks, then differs.
    s.add_request(req("fork", 12, tokens=list(range(10, 18)) + [1, 1, 1, 1]))
    so = s.schedule()
    new = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert new == {"same": 8, "fork": 8}
    assert so.num_scheduled_tokens["same"] == 4 and so.num_scheduled_tokens["fork"] == 4
    shared = s.kv.req_to_blocks["same"][:2]
    assert shared == s.kv.req_to_blocks["first"][:2] == s.kv.req_to_blocks["fork"][:2]
    assert all(b.ref_cnt == 3 for b in shared)
    check_invariants(s)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
), max_size=60)


@settings(max_examples=1500, deadline=None)
@given(ops=OPS, num_blocks=st.integers(9, 24), budget=st.integers(1, 24),
       max_seqs=st.integers(1, 6), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), threshold=st.sampled_from([0, 3]))
def test_random_workloads_never_leak(ops, num_blocks, budget, max_seqs, caching, policy,
                                     threshold):
    s = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, max_len=32,
                       caching=caching, policy=policy, long_prefill_token_threshold=threshold)
    added: list[str] = []
    finished: set[str] = set()
    for op, a, b, c in ops:
        if op == "add":
            rid = str(len(added))
            added.append(rid)
            # Prompts share prefixes (token = position % 3 + c): prefix hits are common.
            tokens = [(i % 3) + c for i in range(min(a, 31))]
            s.add_request(req(rid, len(tokens), max_tokens=b, eos=(), priority=c,
                              tokens=tokens))
        elif op == "abort" and added:
            rid = added[a % len(added)]
            s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            finished.add(rid)
        else:
            finished |= {o.req_id for o in fake_run(s, s.schedule()) if o.finish_reason}
        check_invariants(s)
    for _ in range(2000):  # drain: everything must finish
        if not s.has_unfinished_requests():
            break
        finished |= {o.req_id for o in fake_run(s, s.schedule()) if o.finish_reason}
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert finished == set(added)
    assert s.kv.block_pool.get_num_free_blocks() == num_blocks - 1
