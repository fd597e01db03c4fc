"""The Triton backend on CUDA: against the PyTorch reference backend, against dense SDPA,
under CUDA-graph capture and replay, at long contexts, and as the automatic choice."""
from __future__ import annotations

import pytest
import torch

from attention_batches import dense_reference, make_batch, random_shapes, run_backend
from kiln.attention.backend import AttentionLayerSpec
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size,heads,kv_heads", [(64, 9, 3), (128, 32, 8), (128, 8, 8),
                                                      (64, 16, 1), (80, 4, 2)])
def test_matches_reference_and_sdpa(dtype, block_size, head_size, heads, kv_heads):
    seed = block_size * 1000 + head_size + heads
    shapes = random_shapes(seed, 12, max_context=700)
    batch = make_batch(shapes, heads, kv_heads, head_size, block_size, pad=7, seed=seed,
                       dtype=dtype, device="cuda")
    spec = AttentionLayerSpec(heads, kv_heads, head_size, head_size ** -0.5)
    n = batch.metadata.num_actual_tokens
    out, cache = run_backend(TritonPagedBackend, batch, spec)
    ref_out, ref_cache = run_backend(TorchPagedBackend, batch, spec)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float(), ref_out[:n].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out[:n].float(), dense_reference(batch, spec).float(),
                               atol=tol, rtol=tol)
    assert torch.equal(cache, ref_cache)
    assert out[n:].isnan().all()


def test_long_context_decode():
    """Contexts of thousands of tokens over a scattered block table (int64 offsets)."""
    shapes = [(4000, 1), (2500, 1), (1, 1), (3000, 17)]
    spec = AttentionLayerSpec(32, 8, 128, 128 ** -0.5)
    batch = make_batch(shapes, 32, 8, 128, 16, pad=0, seed=1, dtype=torch.bfloat16,
                       device="cuda")
    n = batch.metadata.num_actual_tokens
    out, _ = run_backend(TritonPagedBackend, batch, spec)
    torch.testing.assert_close(out[:n].float(), dense_reference(batch, spec).float(),
                               atol=2e-2, rtol=2e-2)


def test_cuda_graph_replay_serves_a_different_batch_of_the_same_shape():
    """AttentionCGSupport.ALWAYS: capture on one batch, replay on another with other
    lengths, prefill/decode mix and padding (same padded token and request counts)."""
    spec = AttentionLayerSpec(8, 2, 64, 0.125)
    shape_kw = dict(heads=8, kv_heads=2, head_size=64, block_size=16, num_blocks=64,
                    max_blocks=12, dtype=torch.bfloat16, device="cuda")
    first = make_batch([(10, 1), (0, 20), (50, 1)], pad=2, empty_seqs=2, seed=1, **shape_kw)
    # 24 tokens, 5 request rows, like `first`: a chunk with context, decodes, padding.
    second = make_batch([(100, 9), (3, 1), (0, 5), (7, 1)], pad=8, empty_seqs=1, seed=2,
                        **shape_kw)
    md = first.metadata
    static = {"query": first.query.clone(), "key": first.key.clone(),
              "value": first.value.clone(), "cache": first.cache.clone()}
    out = torch.zeros_like(first.query)
    backend = TritonPagedBackend(spec)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (JIT) outside the capture
        backend.forward(static["query"], static["key"], static["value"],
                        static["cache"].clone(), md, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(static["query"], static["key"], static["value"], static["cache"],
                        md, out)
    # Replay with the second batch copied into the same buffers.
    sm = second.metadata
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        getattr(md, name).copy_(getattr(sm, name))
    for name, src in (("query", second.query), ("key", second.key), ("value", second.value),
                      ("cache", second.cache)):
        static[name].copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    n = sm.num_actual_tokens
    expected = dense_reference(second, spec)
    torch.testing.assert_close(out[:n].float(), expected.float(), atol=2e-2, rtol=2e-2)
    _, ref_cache = run_backend(TorchPagedBackend, second, spec)
    assert torch.equal(static["cache"], ref_cache)


def test_chosen_automatically_and_greedy_tokens_match_torch_backend(tiny_models):
    from conftest import random_prompts
    from kiln import LLM, SamplingParams
    from kiln.attention.selector import select_backend

    assert select_backend(None, 64, torch.bfloat16, torch.device("cuda")) is TritonPagedBackend
    path = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [11, 4, 19, 40], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch", None):
        # float32: in bf16 (the CUDA default for fp32 checkpoints) the two backends' sums
        # round differently and a random tiny model's near-tied logits flip greedy tokens.
        llm = LLM(path, progress=False, optimization_level=0, device="cuda", max_model_len=128,
                  max_num_batched_tokens=32, attention_backend=backend, dtype="float32")
        tokens[llm.engine.runner.attn_backend_cls.name] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
