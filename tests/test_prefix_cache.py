"""Prefix caching end to end: hashes, hits, parity with caching off, stats."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.kv_cache.block_hash import hash_block

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_block_hashes_are_chained_salted_and_stable_across_processes():
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a and len(a) == 16
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])  # names its prefix
    assert hash_block(None, [1, 2, 3, 4], b"tenant-a") != a
    code = "from kiln.kv_cache.block_hash import hash_block; print(hash_block(None, [1, 2, 3, 4]).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == a.hex()


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_shared_prefix_batch_matches_no_caching_and_transformers(tiny):
    path, hf = tiny
    system = random_prompts(1, [40], seed=7)[0]
    prompts = [system + tail for tail in random_prompts(5, [3, 9, 17, 1, 6], seed=8)]
    cached = LLM(str(path), dtype="float32", progress=False, optimization_level=0, max_model_len=128)
    plain = LLM(str(path), dtype="float32", progress=False, optimization_level=0, max_model_len=128,
                enable_prefix_caching=False)
    first = _run(cached, prompts[:1])  # fills the cache with the shared prefix
    again = _run(cached, prompts)
    stats = cached.engine.get_stats()
    assert stats.prefix_cache_hits >= 4 * 32 and 0 < stats.prefix_cache_hit_rate < 1
    assert plain.engine.get_stats().prefix_cache_queries == 0
    assert again == _run(plain, prompts)
    assert again[0] == first[0]
    assert again == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    pool = cached.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and pool.cached


def test_full_prompt_hit_still_computes_one_token(tiny):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=0, max_model_len=128)
    prompt = random_prompts(1, [33], seed=3)[0]  # 2 full blocks + 1 token
    first = _run(llm, [prompt])
    scheduled = []
    original = llm.engine.scheduler.schedule

    def recording():
        out = original()
        scheduled.append((out.scheduled_new_reqs, dict(out.num_scheduled_tokens)))
        return out

    llm.engine.scheduler.schedule = recording
    second = _run(llm, [prompt])
    new_reqs, counts = scheduled[0]
    assert new_reqs[0].num_computed_tokens == 32 and list(counts.values()) == [1]
    assert second == first
    exact = random_prompts(1, [32], seed=4)[0]  # exactly 2 blocks: the hit stops at 1
    _run(llm, [exact])
    scheduled.clear()
    _run(llm, [exact])
    assert scheduled[0][0][0].num_computed_tokens == 16


def test_priority_policy_runs_in_the_engine(tiny):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=0, max_model_len=64, num_kv_blocks=6,
              scheduling_policy="priority")
    prompts = random_prompts(4, [20, 20, 20, 20], seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False, priority=[3, 0, 2, 1])
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    plain = LLM(str(path), dtype="float32", progress=False, optimization_level=0, max_model_len=64)
    assert [o.outputs[0].token_ids for o in outs] == _run(
        plain, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
