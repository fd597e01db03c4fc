"""Kept rows (kiln.runner.kept_rows): the last decoder layer computes, after attention,
only the rows the step reads. The kernels' hint (csrc/kept_rows.h), the attention op's
kept query rows, and an engine whose sampled rows agree with every row computed."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from attention_batches import make_batch, run_backend
from kiln.attention.backend import AttentionLayerSpec
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.ops.linear import linear, linear_quant, linear_quant_silu, linear_silu, pack
from kiln.ops.quant_packing import pack_q4, quantize_int8

pytestmark = pytest.mark.usefixtures("cpu_kernels_loaded")

M, K, N = 70, 96, 96


def _hint(rows: list[int] | int) -> torch.Tensor:
    hint = torch.full((1 + M,), -1, dtype=torch.int64)
    if isinstance(rows, int):
        hint[0] = rows
    else:
        hint[0] = len(rows)
        hint[1: 1 + len(rows)] = torch.tensor(rows)
    return hint


def _ops(g: torch.Generator):
    """(name, op(x, hint)) for each kernel that takes the hint."""
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    q4 = pack_q4(torch.randint(0, 16, (N, K), generator=g),
                 torch.rand(N, K // 32, generator=g) * 0.1,
                 torch.randn(N, K // 32, generator=g) * 0.1)
    i8 = quantize_int8(torch.randn(N, K, generator=g))
    ops = [("packed", lambda x, h: linear(x, w, None, pack(w), 0, h)),
           ("packed_silu", lambda x, h: linear_silu(x, w, pack(w), 0, h))]
    for (name, q), panel_from in itertools.product((("q4", q4), ("int8", i8)), (0, 1)):
        ops += [(f"{name}/{panel_from}",
                 lambda x, h, q=q, p=panel_from: linear_quant(x, q.codes, q.scales, q.mins,
                                                              None, q.fmt, p, h)),
                (f"{name}_silu/{panel_from}",
                 lambda x, h, q=q, p=panel_from: linear_quant_silu(x, q.codes, q.scales,
                                                                   q.mins, q.fmt, p, h))]
    return ops


def test_linears_compute_the_kept_rows_alone_and_zero_the_others():
    """The kept rows (any order) are the product of those rows alone, bit for bit; the
    others are zeros. -1, or as many rows as x has, is every row; 0 rows is all zeros; a
    row past x fails."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    kept = [69, 3, 40]
    others = [r for r in range(M) if r not in kept]
    for name, op in _ops(g):
        full = op(x, None)
        got = op(x, _hint(kept))
        assert got.shape == full.shape and got.dtype == full.dtype, name
        assert torch.equal(got[kept], op(x[kept], None)), name
        assert torch.allclose(got[kept].float(), full[kept].float(), atol=2e-2, rtol=2e-2)
        assert got[others].eq(0).all(), name
        assert torch.equal(op(x, _hint(-1)), full) and torch.equal(op(x, _hint(M)), full)
        assert op(x, _hint(0)).eq(0).all(), name
        with pytest.raises(IndexError):
            op(x, _hint([3, M]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_layer_computes_only_each_requests_kept_query_rows(dtype):
    """At `keep_layer` a prefill entry computes only its last `query_keep` rows, each as
    it is among all of them (bf16: the same bits; fp32's SDPA takes a masked path for a
    suffix), and zeroes the others; decode rows and other layers are untouched."""
    heads, kv_heads, D = 9, 3, 64
    spec = AttentionLayerSpec(heads, kv_heads, D, D ** -0.5)
    shapes = [(0, 600), (70, 50), (0, 37), (5, 1), (500, 40)]
    batch = make_batch(shapes, heads, kv_heads, D, 16, pad=3, seed=7, dtype=dtype)
    keep = [1, 0, 3, 1, 40]
    full, full_cache = run_backend(CpuPagedBackend, batch, spec)
    md = dataclasses.replace(batch.metadata, query_keep=keep, keep_layer=0)
    got, cache = run_backend(CpuPagedBackend, dataclasses.replace(batch, metadata=md), spec)
    assert torch.equal(cache, full_cache)  # every row's K and V are written
    other = run_backend(CpuPagedBackend, dataclasses.replace(
        batch, metadata=dataclasses.replace(md, keep_layer=1)), spec)[0]
    assert torch.equal(other.nan_to_num(), full.nan_to_num())  # not this layer: all rows
    start = 0
    for (_, n), k in zip(shapes, keep):
        rows = slice(start + n - k, start + n)
        if dtype == torch.bfloat16:
            assert torch.equal(got[rows], full[rows])
        else:
            torch.testing.assert_close(got[rows], full[rows], atol=1e-5, rtol=1e-5)
        assert got[start: start + n - k].eq(0).all()
        start += n


@pytest.fixture(scope="module")
def bf16_llm(tiny_models, tmp_path_factory):
    """Traced here (its own cache), so that the test can read the graph."""
    from kiln import LLM

    return LLM(str(tiny_models["llama"][0]), dtype="bfloat16", progress=False,
               optimization_level=2, max_model_len=256, enable_prefix_caching=False,
               compilation={"cache_dir": str(tmp_path_factory.mktemp("kept"))})


def _spy(runner, monkeypatch):
    """Record each step's kept rows and hidden states (the runner's own calls run)."""
    seen = []
    forward_rows = runner.forward_rows

    def spy(rows, uniform_query_len=1, query_keep=None):
        hidden = forward_rows(rows, uniform_query_len, query_keep)
        seen.append((query_keep, runner.kept_rows.buffer[0].item(), hidden.clone()))
        return hidden

    monkeypatch.setattr(runner, "forward_rows", spy)
    return seen


def test_engine_samples_the_same_rows_with_the_last_layer_cut(bf16_llm, monkeypatch):
    """bf16 -O2: a batch of prompts samples the same tokens whether the last layer
    computes every row or only the sampled ones, from nearly the same hidden states; the
    hint was on (its buffer named the rows during the forward, reset after) and took
    effect (the unsampled rows' hidden states differ), and prompt logprobs turn it off
    for their step."""
    from kiln import SamplingParams

    runner = bf16_llm.engine.runner
    assert runner.kept_rows.enabled
    # The last layer's hint is a buffer like the others' "every row": one compiled region.
    piece = runner.compile_backend.split_gm._modules["submod_0"]
    calls = [n for n in piece.graph.nodes if "invoke_subgraph" in str(n.target)]
    assert len(calls) == 2 and len({n.args[0].target for n in calls}) == 1
    seen = _spy(runner, monkeypatch)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(n)]}
               for i, n in enumerate((90, 33, 150))]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    runs = {}
    for on in (True, False):
        runner.kept_rows.enabled = on
        seen.clear()
        outs = bf16_llm.generate(prompts, params, use_tqdm=False)
        runs[on] = ([o.outputs[0].token_ids for o in outs], seen[0])
        assert runner.kept_rows.buffer[0].item() == -1
    runner.kept_rows.enabled = True
    (tokens_on, (keep, count, hidden_on)), (tokens_off, (_, _, hidden_off)) = \
        runs[True], runs[False]
    assert tokens_on == tokens_off
    assert keep == [1, 1, 1] and count == 3
    last = [89, 90 + 32, 90 + 33 + 149]
    torch.testing.assert_close(hidden_on[last].float(), hidden_off[last].float(),
                               atol=3e-2, rtol=3e-2)
    assert not torch.equal(hidden_on[:89], hidden_off[:89])
    seen.clear()
    bf16_llm.generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1),
                      use_tqdm=False)
    assert seen[0][0] is None and seen[0][1] == -1
