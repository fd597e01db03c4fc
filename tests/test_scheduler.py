"""Scheduler behaviour and invariants, driven without a model: a fake runner output
samples a fixed token for every request that reached the end of its known tokens."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from kiln.engine import Request, RequestStatus
from kiln.sampling import SamplingParams
from kiln.scheduler import (FullAttentionSpec, KVCacheManager, ModelRunnerOutput, Scheduler,
                            SchedulerOutput)

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, max_len=64) -> Scheduler:
    return Scheduler(KVCacheManager(SPEC, num_blocks), max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_len)


def req(rid: str, n_prompt: int, max_tokens: int = 4, eos=(2,)) -> Request:
    return Request(rid, [5] * n_prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                   eos)


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


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
), max_size=60)


@settings(max_examples=1000, deadline=None)
@given(ops=OPS, num_blocks=st.integers(9, 24), budget=st.integers(1, 24),
       max_seqs=st.integers(1, 6))
def test_random_workloads_never_leak(ops, num_blocks, budget, max_seqs):
    s = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, max_len=32)
    added: list[str] = []
    finished: set[str] = set()
    for op, a, b in ops:
        if op == "add":
            rid = str(len(added))
            added.append(rid)
            s.add_request(req(rid, min(a, 31), max_tokens=b, eos=()))
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
