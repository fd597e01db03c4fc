"""CUDAGraphWrapper on the CPU test graph: capture then replay, pass-through, nesting,
the static-address contract; then the runner end to end (padding, FULL and PIECEWISE)."""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import hf_greedy, random_prompts
from kiln import LLM, SamplingParams
from kiln.attention.backend import AttentionCGSupport
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.forward_context import (BatchDescriptor as BD, ForwardContext,
                                            get_forward_context, set_forward_context)
from kiln.config.compilation import CUDAGraphMode as M
from kiln.graphs.graph import CpuTestGraph
from kiln.graphs.wrapper import CUDAGraphWrapper, capture_phase

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def step(fn, *args, mode=M.NONE, desc=None):
    with set_forward_context(ForwardContext(None, [], [], desc, None, mode)):
        return fn(*args)


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_capture_then_replay_overwrites_the_captured_output():
    buf = torch.arange(4.0)
    w = CUDAGraphWrapper(lambda x: x * 2 + 1, M.FULL, CpuTestGraph)
    with capture_phase():
        first = step(w, buf, mode=M.FULL, desc=BD(4))
        assert not gc.isenabled()
    assert gc.isenabled() and w.num_captures == 1
    buf.fill_(10.0)
    again = step(w, buf, mode=M.FULL, desc=BD(4))
    assert again is first and again.tolist() == [21.0] * 4 and w.num_replays == 1


def test_passes_through_on_none_on_another_mode_and_without_context():
    inner = Counted(lambda x: x + 1)
    w = CUDAGraphWrapper(inner, M.PIECEWISE, CpuTestGraph)
    x = torch.zeros(2)
    with capture_phase():
        step(w, x, mode=M.FULL, desc=BD(2, 2, True))
        step(w, x, mode=M.NONE, desc=BD(2))
        w(x)
    assert inner.calls == 3 and w.num_captures == 0


def test_capture_while_serving_raises():
    w = CUDAGraphWrapper(lambda x: x, M.FULL, CpuTestGraph, name="model")
    with pytest.raises(RuntimeError, match="only allowed during start-up"):
        step(w, torch.zeros(2), mode=M.FULL, desc=BD(2))


def test_replay_with_a_moved_input_raises():
    buf = torch.zeros(4)
    w = CUDAGraphWrapper(lambda x: x + 1, M.PIECEWISE, CpuTestGraph)
    with capture_phase():
        step(w, buf, mode=M.PIECEWISE, desc=BD(4))
    with pytest.raises(RuntimeError, match="input 0 moved since capture"):
        step(w, buf.clone(), mode=M.PIECEWISE, desc=BD(4))


def test_full_outside_piecewise_inside_nest_with_the_right_capture_counts():
    a = CUDAGraphWrapper(lambda x: x + 1, M.PIECEWISE, CpuTestGraph, name="a")
    b = CUDAGraphWrapper(lambda x: x * 3, M.PIECEWISE, CpuTestGraph, name="b")
    # Attention runs eagerly between pieces, in place on the previous piece's output.
    eager = Counted(lambda x: x.sub_(1))
    model = CUDAGraphWrapper(lambda x: b(eager(a(x))), M.FULL, CpuTestGraph, name="model")
    x = torch.ones(4)
    with capture_phase():
        for n in (4, 2):  # largest first
            step(model, x[:n], mode=M.PIECEWISE, desc=BD(n))
        step(model, x[:2], mode=M.FULL, desc=BD(2, 2, True))
    assert (a.num_captures, b.num_captures, model.num_captures) == (2, 2, 1)
    x.fill_(2.0)
    out = step(model, x[:4], mode=M.PIECEWISE, desc=BD(4))
    assert out.tolist() == [6.0] * 4 and (a.num_replays, model.num_replays) == (1, 0)
    out = step(model, x[:2], mode=M.FULL, desc=BD(2, 2, True))
    assert out.tolist() == [6.0] * 2 and (a.num_replays, model.num_replays) == (1, 1)
    assert (a.num_captures, b.num_captures, model.num_captures) == (2, 2, 1)


# ---- the runner, end to end on a tiny model (eager compiler adaptor: no codegen) ---------

class DecodeGraphBackend(TorchPagedBackend):
    """The PyTorch backend declaring FULL decode support, and recording what it sees. Safe
    under the CPU test graph only (which re-runs the Python on replay)."""

    name = "torch-decode-graph-test"
    cg_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    seen: list[tuple] = []

    def forward(self, query, key, value, kv_cache, metadata, output):
        ctx = get_forward_context()
        if self.spec is type(self).first_spec:
            type(self).seen.append((ctx.cudagraph_mode, ctx.batch_descriptor,
                                            metadata.slot_mapping.tolist(),
                                            ctx.is_padding.tolist(), metadata.num_reqs))
        super().forward(query, key, value, kv_cache, metadata, output)


def make_llm(path, **comp):
    return LLM(str(path), optimization_level=2, progress=False, max_model_len=128,
               dtype="float32", attention_backend="torch",
               max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
               compilation={"backend": "eager", "graph_backend": "cpu_test",
                            "cudagraph_capture_sizes": [1, 2, 4, 8, 16], **comp})


def test_runner_pads_to_piecewise_graphs_and_keeps_parity(tiny_models):
    path, hf = tiny_models["llama"]
    llm = make_llm(path)  # the PyTorch backend is NEVER: FULL_AND_PIECEWISE -> PIECEWISE
    runner = llm.engine.runner
    assert runner.dispatcher.mode is M.PIECEWISE
    assert [w.num_captures for w in runner.graph_wrappers] == [5, 5, 5]  # L+1 pieces
    prompts = random_prompts(5, [3, 8, 21, 1, 12])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    # 7 decode steps of 5 requests ran as the 8-token graph; none captured while serving.
    assert [w.num_replays for w in runner.graph_wrappers] == [7, 7, 7]
    assert [w.num_captures for w in runner.graph_wrappers] == [5, 5, 5]


def test_runner_full_decode_graphs_pad_requests(tiny_models, monkeypatch):
    path, hf = tiny_models["llama"]
    monkeypatch.setattr("kiln.runner.model_runner.select_backend",
                        lambda *a, **k: DecodeGraphBackend)
    monkeypatch.setattr(DecodeGraphBackend, "first_spec", None, raising=False)
    monkeypatch.setattr(DecodeGraphBackend, "seen", [])
    llm = make_llm(path)
    runner = llm.engine.runner
    DecodeGraphBackend.first_spec = runner.attn_backends[0].spec
    assert runner.dispatcher.mode is M.FULL_AND_PIECEWISE
    *pieces, full = runner.graph_wrappers
    assert [w.num_captures for w in pieces] == [5, 5, 5] and full.num_captures == 4
    DecodeGraphBackend.seen.clear()
    prompts = random_prompts(3, [5, 2, 9], seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]
    prefill, decode = DecodeGraphBackend.seen[0], DecodeGraphBackend.seen[1]
    assert prefill[:2] == (M.PIECEWISE, BD(16))  # 16 prompt tokens: exactly a size
    # 3 decoding requests pad to the 4-token FULL graph: a 4th request of padding.
    mode, desc, slots, is_padding, num_reqs = decode
    assert (mode, desc, num_reqs) == (M.FULL, BD(4, 4, True), 4)
    assert slots[3] == -1 and min(slots[:3]) >= 16 and is_padding == [False] * 3 + [True]
    assert full.num_replays == 7 and [w.num_replays for w in pieces] == [1, 1, 1]


class UniformBatchBackend(DecodeGraphBackend):
    """The recording backend, declaring FULL graphs for uniform multi-token decode."""

    name = "torch-uniform-batch-test"
    cg_support = AttentionCGSupport.UNIFORM_BATCH


def test_runner_full_graphs_verify_draft_tokens(tiny_models, monkeypatch):
    """Speculative decoding with k = 2: uniform decode of 3 tokens per request is a FULL
    key of its own; padding requests take 3 tokens too, and outputs keep parity."""
    path, hf = tiny_models["llama"]
    monkeypatch.setattr("kiln.runner.model_runner.select_backend",
                        lambda *a, **k: UniformBatchBackend)
    monkeypatch.setattr(UniformBatchBackend, "first_spec", None, raising=False)
    monkeypatch.setattr(UniformBatchBackend, "seen", [])
    llm = LLM(str(path), optimization_level=2, progress=False, max_model_len=128,
              dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
              compilation={"backend": "eager", "graph_backend": "cpu_test",
                           "cudagraph_capture_sizes": [1, 2, 4, 8, 16]},
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 1})
    runner = llm.engine.runner
    UniformBatchBackend.first_spec = runner.attn_backends[0].spec
    full = runner.graph_wrappers[-1]
    assert full.num_captures == 8  # 4 request counts x (1, 3) tokens each
    prompts = random_prompts(3, [5, 2, 9], seed=2)
    refs = {tuple(p): hf_greedy(hf, p, 12) for p in prompts}

    class HalfRightDrafter:
        """Every request drafts 2 tokens each step: the true next one, then a wrong one
        (so each verification accepts one and rejects one, in a uniform batch)."""

        def propose(self, rows, states):
            out = {}
            for st in states:
                ref = refs[tuple(st.token_ids[: st.num_prompt_tokens])]
                done = len(st.token_ids) - st.num_prompt_tokens
                if done < len(ref):
                    out[st.req_id] = [ref[done], (ref[done] + 1) % 512]
            return out

    runner.drafter = HalfRightDrafter()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    verify = [(d, n, pad) for mode, d, _, pad, n in UniformBatchBackend.seen
              if mode is M.FULL and d.uniform and d.num_tokens == 3 * d.num_reqs]
    assert verify, [(m, d, n) for m, d, _, _, n in UniformBatchBackend.seen]
    # 3 requests verifying 2 drafts: the 4-request graph, a whole padding request.
    assert (BD(12, 4, True), 4, [False] * 9 + [True] * 3) in verify
    spec = llm.engine.get_stats().spec_decoding
    assert spec.acceptance_rate == pytest.approx(0.5, abs=0.1)


def test_compile_size_skipped_by_padding_fails_at_start_up(tiny_models):
    with pytest.raises(ValueError, match="compile_sizes entry 3"):
        make_llm(tiny_models["llama"][0], compile_sizes=[3])
