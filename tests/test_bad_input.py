"""Misconfiguration fails at start-up with a ValueError naming the field; a bad request
fails alone and the engine keeps serving."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import random_prompts
from kiln import LLM, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"][0]), progress=False, optimization_level=0, max_model_len=64)


def test_too_long_prompt_is_rejected_alone(llm):
    ok = random_prompts(3, [5, 9, 12])
    prompts = [{"prompt_token_ids": ok[0]}, {"prompt_token_ids": [7] * 64},
               {"prompt_token_ids": ok[1]}, {"prompt_token_ids": ok[2]}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "max_model_len is 64" in outs[1].error
    assert all(len(outs[i].outputs[0].token_ids) == 8 for i in (0, 2, 3))
    pool = llm.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    # ...and the engine carries on.
    again = llm.generate({"prompt_token_ids": ok[0]}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt,match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
    ("text without a tokenizer", "no tokenizer"),
    ([[1, 2, 3]], "must be a string or"),  # a bare list of ids: not a prompt
])
def test_other_bad_prompts(llm, prompt, match):
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and match in out.error


def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.engine
    for i, p in enumerate(random_prompts(3, [10, 20, 30])):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, GREEDY)
    engine.step()
    engine.abort_request("abort-1")
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"abort-0", "abort-2"}
    pool = engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_nonexistent_model_path(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nope"), progress=False, optimization_level=0)


def test_unsupported_architecture(tiny_models, tmp_path):
    path = tmp_path / "weird"
    shutil.copytree(tiny_models["llama"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(path), progress=False, optimization_level=0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(dtype="float8"), "dtype"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=12), "block_size"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory"),
    (dict(kv_cache_memory="1GiB", num_kv_blocks=10), "num_kv_blocks"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(optimization_level=7), "optimization_level"),
    (dict(device="tpu"), "device"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_model_dependent_limits_fail_at_startup(tiny_models):
    path = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(path, progress=False, optimization_level=0, max_model_len=100000)
    with pytest.raises(ValueError, match="kv_cache_memory / num_kv_blocks"):
        LLM(path, progress=False, optimization_level=0, max_model_len=256, num_kv_blocks=4)


def test_sampling_params_validation():
    for kwargs, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
