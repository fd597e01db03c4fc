"""Greedy parity with transformers (fp32) on tiny random models of every family, also
under chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_CONFIGS, hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.config.compilation import CUDAGraphMode

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [5, 17, 33, 2, 40, 9]


def _kiln_tokens(path, prompts, **engine_kwargs) -> tuple[LLM, list[list[int]]]:
    engine_kwargs.setdefault("optimization_level", 0)
    llm = LLM(str(path), dtype="float32", progress=False, max_model_len=128, **engine_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = random_prompts(6, LENGTHS)
    return prompts, {kind: [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
                     for kind, (_, model) in tiny_models.items()}


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_greedy_matches_transformers(kind, tiny_models, references):
    prompts, refs = references
    _, tokens = _kiln_tokens(tiny_models[kind][0], prompts)
    assert tokens == refs[kind]


def test_chunked_prefill_keeps_parity(tiny_models, references):
    prompts, refs = references
    # 8 tokens per step: every prompt longer than that is split across steps, and decodes
    # share steps with prefill chunks.
    llm, tokens = _kiln_tokens(tiny_models["llama"][0], prompts, max_num_batched_tokens=8)
    assert tokens == refs["llama"]


def test_preemption_keeps_parity(tiny_models, references):
    prompts, refs = references
    # 9 usable blocks of 16 tokens for six requests of up to 64 tokens: some are
    # preempted and recomputed.
    llm, tokens = _kiln_tokens(tiny_models["llama"][0], prompts, num_kv_blocks=10,
                               block_size=16)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == refs["llama"]
    pool = llm.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_o3_cpp_wrapper_keeps_parity_with_padded_graphs(tiny_models, references):
    """-O3 as a CPU user gets it (Inductor's cpp_wrapper), with the CPU test graphs so its
    decode steps are padded and replayed."""
    prompts, refs = references
    llm, tokens = _kiln_tokens(tiny_models["llama"][0], prompts, optimization_level=3,
                               compilation={"graph_backend": "cpu_test"})
    c = llm.engine.config.compilation
    assert c.inductor_options == {"cpp_wrapper": True} and c.cudagraph_mode
    assert llm.engine.runner.dispatcher.mode is CUDAGraphMode.PIECEWISE
    assert tokens == refs["llama"]


def test_bfloat16_agrees_where_fp32_is_decisive(tiny_models):
    """bf16 keeps ~3 significant digits, so it can only be held to the fp32 answer where
    the fp32 top-2 logit gap is clear."""
    path, model = tiny_models["llama"]
    prompts = random_prompts(6, LENGTHS, seed=1)
    llm = LLM(str(path), dtype="bfloat16", progress=False, optimization_level=0, max_model_len=128)
    assert llm.engine.dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    decisive = 0
    for p, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        with torch.no_grad():
            top = model(torch.tensor([p])).logits[0, -1].topk(2).values
        if top[0] - top[1] > 0.1:
            decisive += 1
            assert out.outputs[0].token_ids[0] == hf_greedy(model, p, 1)[0]
    assert decisive >= 3
