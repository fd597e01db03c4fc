"""Mixtures of experts: Mixtral, Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE and OLMoE,
tiny random models built here, token-exact with transformers in float32 at -O0 and -O2
(with chunked prefill, prefix-cache hits and preemption in play), and the fused op
against a per-token reference."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY, assert_exact_under_pressure, hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.moe.op import fused_moe

MOE = dict(TINY, intermediate_size=96)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**MOE, num_local_experts=4,
                                                  num_experts_per_tok=2,
                                                  sliding_window=None),
    # OLMoE: Q/K norms over the whole projection, Q/K/V clamped.
    "olmoe": lambda: transformers.OlmoeConfig(**MOE, num_experts=4, num_experts_per_tok=2,
                                              clip_qkv=3.0),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **MOE, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHARED = random_prompts(1, [40], seed=21)[0]
PROMPTS = [SHARED + t for t in random_prompts(3, [5, 30, 12], seed=22)] \
    + random_prompts(1, [70], seed=23)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_model(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    model = model.float().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("level", [0, 2])
def test_moe_families_match_transformers(moe_model, level):
    path, refs = moe_model
    # 14 usable blocks for four requests of up to 86 tokens: preemption; 32 tokens per
    # request-step chunk the prompts; SHARED gives prefix-cache hits.
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=level,
              max_model_len=128, num_kv_blocks=15, long_prefill_token_threshold=32)
    assert_exact_under_pressure(llm, PROMPTS, GREEDY, refs, compiled=level == 2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_a_per_token_reference(renormalize):
    g = torch.Generator().manual_seed(0)
    T, H, inter, E, k = 37, 24, 20, 6, 2  # odd sizes; some experts get no token
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, 5] = -30.0  # expert 5 is never chosen
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    got = fused_moe(x, logits, w13, w2, k, renormalize)
    want = torch.zeros_like(x)
    for t in range(T):
        p = torch.softmax(logits[t], dim=-1)
        wts, ids = torch.topk(p, k)
        if renormalize:
            wts = wts / wts.sum()
        for w, e in zip(wts, ids):
            gate, up = (w13[e] @ x[t]).split(inter)
            want[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_compiles_into_one_graph_with_the_op_opaque():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g)
    logits = torch.randn(5, 4, generator=g)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    f = torch.compile(lambda a, b: fused_moe(a * 2, b, w13, w2, 2, True) + 1,
                      fullgraph=True, backend="aot_eager", dynamic=True)
    torch.testing.assert_close(f(x, logits), fused_moe(x * 2, logits, w13, w2, 2, True) + 1)


def test_moe_refuses_tensor_parallelism_and_unknown_architectures_list_them(moe_model,
                                                                             tmp_path):
    import json

    path, _ = moe_model
    with pytest.raises(ValueError, match="does not shard experts"):
        LLM(str(path), dtype="float32", progress=False, optimization_level=0,
            tensor_parallel_size=2)
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config,
                                                      "architectures": ["GrokForCausalLM"]}))
    with pytest.raises(ValueError, match="MixtralForCausalLM.*Qwen2MoeForCausalLM"):
        LLM(str(tmp_path), dtype="float32", progress=False, optimization_level=0)

