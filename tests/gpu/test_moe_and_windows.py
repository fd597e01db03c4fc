"""CUDA checks for #18's kernels: the Triton fused-MoE kernel against the grouped loop
(also replayed from one captured CUDA graph for new routings), and a Gemma 2 model
(sliding windows, softcaps) on the Triton attention backend under FULL decode graphs,
token-exact with transformers. Skipped without CUDA; `scripts/gpu_check.sh` runs them."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY, hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.moe.op import grouped_experts, route
from kiln.moe.triton_moe import fused_experts_triton

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _experts(E: int, H: int, inter: int, dtype: torch.dtype, g: torch.Generator):
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5).to("cuda", dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * inter ** -0.5).to("cuda", dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 8, 2), (300, 64, 6)])
def test_triton_moe_matches_the_grouped_loop(dtype, T, E, k):
    g = torch.Generator().manual_seed(T + E)
    w13, w2 = _experts(E, 256, 320, dtype, g)
    x = torch.randn(T, 256, generator=g).to("cuda", dtype)
    weights, experts = route(torch.randn(T, E, generator=g).cuda(), k, True)
    got = fused_experts_triton(x, weights.to(dtype), experts, w13, w2).float()
    want = grouped_experts(x.float(), weights, experts, w13.float(), w2.float())
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert ((got - want).abs().max() / want.abs().max()).item() < tol


@torch.inference_mode()
def test_triton_moe_replays_one_graph_for_any_routing():
    """Nothing is read back to the host: a graph captured for one routing computes every
    other routing of the same token count."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = _experts(8, 128, 256, torch.float32, g)
    x = torch.randn(16, 128, generator=g).cuda()
    logits = torch.randn(16, 8, generator=g).cuda()

    def step() -> torch.Tensor:
        weights, experts = route(logits, 2, True)
        return fused_experts_triton(x, weights, experts, w13, w2)

    step()  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        logits.copy_(torch.randn(16, 8, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        weights, experts = route(logits, 2, True)
        torch.testing.assert_close(out, grouped_experts(x, weights, experts, w13, w2),
                                   rtol=1e-4, atol=1e-4)


def test_gemma2_windows_and_softcaps_under_full_graphs(tmp_path):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**dict(TINY, num_hidden_layers=4), head_dim=32,
                                       sliding_window=24, query_pre_attn_scalar=24,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(tmp_path)
    prompts = random_prompts(4, [70, 5, 33, 12], seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, optimization_level=2,
              max_model_len=128, attention_backend="triton", device="cuda",
              compilation={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == \
        [hf_greedy(hf, p, params.max_tokens) for p in prompts]
    assert llm.engine.runner.graph_wrappers[-1].num_replays > 0  # FULL decode graphs ran
