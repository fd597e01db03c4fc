"""Real CUDA graphs (`torch.cuda.CUDAGraph`): FULL and PIECEWISE capture and replay, equal
to eager, with padded batches. Skipped without CUDA; `scripts/gpu_check.sh` runs them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import random_prompts
from kiln import LLM, SamplingParams
from kiln.attention.backend import AttentionCGSupport
from kiln.attention.forward_context import ForwardContext, set_forward_context
from kiln.attention.selector import BACKENDS
from kiln.config.compilation import CUDAGraphMode as M
from kiln.graphs.dispatcher import GraphDispatcher
from kiln.graphs.graph import CudaGraph, global_graph_pool
from kiln.graphs.wrapper import CUDAGraphWrapper, capture_phase
from kiln.runner.cudagraphs import graph_factory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 4, 8, 16]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def ctx(mode, desc):
    return set_forward_context(ForwardContext(None, [], [], desc, None, mode))


def capture_all(dispatcher, wrapper, eager, buf):
    with capture_phase():
        for mode, descs in dispatcher.capture_descriptors():
            for desc in descs:
                eager(buf[:desc.num_tokens])  # warm-up outside the capture
                with ctx(mode, desc):
                    wrapper(buf[:desc.num_tokens])


@torch.inference_mode()
def test_full_graph_replays_equal_eager_on_padded_batches():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64)).cuda()
    buf = torch.zeros(16, 64, device="cuda")  # the persistent input buffer
    wrapper = CUDAGraphWrapper(mlp, M.FULL, graph_factory("auto"), name="mlp")
    dispatcher = GraphDispatcher(M.FULL, SIZES, max_num_seqs=16)
    capture_all(dispatcher, wrapper, mlp, buf)
    assert wrapper.num_captures == len(SIZES)
    for n in (3, 5, 13):
        x = torch.randn(n, 64, device="cuda")
        mode, desc = dispatcher.dispatch(n)
        assert mode is M.FULL and desc.num_tokens == {3: 4, 5: 8, 13: 16}[n]
        buf[:n] = x
        buf[n:desc.num_tokens] = 0  # padding rows
        with ctx(mode, desc):
            out = wrapper(buf[:desc.num_tokens])
        torch.testing.assert_close(out[:n], mlp(x), rtol=1e-5, atol=1e-5)
    assert wrapper.num_replays == 3


@torch.inference_mode()
def test_full_outside_piecewise_inside_on_cuda():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(32, 32).cuda(), nn.Linear(32, 32).cuda()
    factory = graph_factory("auto")
    a = CUDAGraphWrapper(lambda x: lin1(x), M.PIECEWISE, factory, "a", weak_ref_output=False)
    b = CUDAGraphWrapper(lambda x: lin2(x), M.PIECEWISE, factory, "b", weak_ref_output=True)

    def model(x):
        h = a(x)
        h.mul_(0.5)  # "attention": eager, in place on the previous graph's output
        return b(h)

    full = CUDAGraphWrapper(model, M.FULL, factory, "model")
    dispatcher = GraphDispatcher(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=8)
    buf = torch.zeros(16, 32, device="cuda")
    capture_all(dispatcher, full, model, buf)
    assert (a.num_captures, b.num_captures, full.num_captures) == (5, 5, 4)
    for n, uniform in ((3, True), (5, False), (13, True)):
        x = torch.randn(n, 32, device="cuda")
        mode, desc = dispatcher.dispatch(n, uniform)
        buf[:n] = x
        with ctx(mode, desc):
            out = full(buf[:desc.num_tokens])
        torch.testing.assert_close(out[:n], lin2(lin1(x) * 0.5), rtol=1e-5, atol=1e-5)
    assert full.num_replays == 1 and a.num_replays == 2  # 3: FULL; 5 and 13: PIECEWISE


def test_replay_with_a_moved_input_raises_when_checking():
    graph = CudaGraph(global_graph_pool(), "g", check_addresses=True)
    buf = torch.zeros(8, device="cuda")
    with capture_phase():
        graph.capture(lambda x: x + 1, (buf,), True, first_in_phase=True)
    graph.replay((buf,))
    with pytest.raises(RuntimeError, match="moved since capture"):
        graph.replay((buf.clone(),))


def _cuda_llm(path, level, backend=None, **comp):
    return LLM(str(path), device="cuda", dtype="float32", optimization_level=level,
               progress=False, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
               num_kv_blocks=64, attention_backend=backend,
               compilation={"cudagraph_capture_sizes": SIZES, **comp})


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_runner_piecewise_graphs_equal_eager(tiny_models, tmp_path):
    path = tiny_models["llama"][0]
    prompts = random_prompts(5, [3, 8, 21, 1, 12])  # 5 decoding requests pad to 8
    eager = _generate(_cuda_llm(path, 0), prompts)
    # The torch attention backend supports no FULL graph: the runner captures PIECEWISE
    # only (the automatic CUDA choice, Triton, adds FULL decode graphs; tested below).
    llm = _cuda_llm(path, 2, cache_dir=str(tmp_path), backend="torch")
    runner = llm.engine.runner
    assert runner.dispatcher.mode is M.PIECEWISE
    assert _generate(llm, prompts) == eager
    assert all(w.num_replays > 0 for w in runner.graph_wrappers)


FULL_BACKENDS = [n for n, cls in BACKENDS.items()
                 if cls.cg_support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE]


@pytest.mark.skipif(not FULL_BACKENDS, reason="no attention backend supports FULL graphs yet")
@pytest.mark.parametrize("backend", FULL_BACKENDS)
def test_runner_full_decode_graphs_equal_eager(tiny_models, tmp_path, backend):
    path = tiny_models["llama"][0]
    prompts = random_prompts(3, [5, 2, 9])  # 3 decoding requests pad to 4
    eager = _generate(_cuda_llm(path, 0, cudagraph_mode="none"), prompts)
    llm = LLM(str(path), device="cuda", dtype="float32", optimization_level=2,
              progress=False, max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64,
              num_kv_blocks=64, attention_backend=backend,
              compilation={"cudagraph_capture_sizes": SIZES, "cache_dir": str(tmp_path)})
    assert llm.engine.runner.dispatcher.mode.has_full_cudagraphs()
    assert _generate(llm, prompts) == eager
    assert llm.engine.runner.graph_wrappers[-1].num_replays > 0
