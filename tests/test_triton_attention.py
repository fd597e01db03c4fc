"""The Triton backend against the PyTorch reference, on the CPU under TRITON_INTERPRET=1.

The interpreter runs each kernel program in numpy: correct but slow, so shapes stay small.
tests/conftest.py sets TRITON_INTERPRET=1 at session start on hosts without CUDA (it must
precede Triton's first import); with CUDA these tests skip and tests/gpu/ runs the kernels.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from attention_batches import Batch, dense_reference, make_batch, random_shapes, run_backend
from conftest import random_prompts
from kiln.attention import selector
from kiln.attention.backend import AttentionLayerSpec
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend
from kiln.attention.selector import select_backend
from kiln.ops.triton_runtime import interpreter_reason
from kiln.platforms.cpu import CpuPlatform

pytest.importorskip("triton")

CPU = torch.device("cpu")


@pytest.fixture
def interpret() -> None:
    reason = interpreter_reason()
    if reason is not None:
        pytest.skip(reason)


def run_both(batch: Batch, spec: AttentionLayerSpec
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(triton output, triton cache, reference output, reference cache); outputs cut to
    the real rows."""
    n = batch.metadata.num_actual_tokens
    out, cache = run_backend(TritonPagedBackend, batch, spec)
    ref_out, ref_cache = run_backend(TorchPagedBackend, batch, spec)
    return out[:n], cache, ref_out[:n], ref_cache


# (block_size, head_size, heads, kv_heads, num_seqs, pad): block sizes 16 and 32, head
# sizes 64 and 128 (and 48: a non-power-of-two, padded in the kernel), GQA ratios 1..8.
CASES = [
    (16, 64, 4, 4, 4, 3),
    (32, 64, 8, 2, 5, 0),
    (16, 128, 4, 1, 3, 2),
    (32, 128, 6, 2, 4, 5),
    (16, 48, 8, 1, 3, 1),
]


@pytest.mark.parametrize("block_size,head_size,heads,kv_heads,num_seqs,pad", CASES)
def test_matches_reference_on_random_mixed_batches(interpret, block_size, head_size, heads,
                                                   kv_heads, num_seqs, pad):
    seed = block_size + head_size + heads * 7 + kv_heads
    shapes = random_shapes(seed, num_seqs)
    batch = make_batch(shapes, heads, kv_heads, head_size, block_size, pad, seed)
    spec = AttentionLayerSpec(heads, kv_heads, head_size, head_size ** -0.5)
    out, cache, ref_out, ref_cache = run_both(batch, spec)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, dense_reference(batch, spec), atol=2e-5, rtol=2e-5)
    # The same slots were written and nothing else (padding rows have slot -1).
    assert torch.equal(cache, ref_cache)


def test_decode_only_and_prefill_only_batches(interpret):
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    for shapes in ([(17, 1), (0, 1), (33, 1), (5, 1)], [(0, 19), (0, 3)]):
        batch = make_batch(shapes, 4, 2, 64, 16, pad=2, seed=len(shapes))
        out, cache, ref_out, ref_cache = run_both(batch, spec)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        assert torch.equal(cache, ref_cache)


def test_graph_padded_request_rows_are_ignored(interpret):
    """Empty trailing sequences (q_len 0, seq_len 0) and padding tokens, as a captured
    graph's padded batch has them, leave the real rows' results unchanged."""
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    shapes = [(10, 1), (0, 6), (40, 1)]
    padded = make_batch(shapes, 4, 2, 64, 16, pad=4, seed=5, empty_seqs=3)
    plain = make_batch(shapes, 4, 2, 64, 16, pad=4, seed=5)
    out, cache = run_backend(TritonPagedBackend, padded, spec)
    _, _, ref_out, ref_cache = run_both(plain, spec)
    n = ref_out.shape[0]
    torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=2e-5)
    assert out[n:].isnan().all()  # padding rows are never written
    assert torch.equal(cache, ref_cache)


def test_host_side_lengths_are_never_read(interpret):
    """What a CUDA graph freezes at capture (the metadata's host ints and lists) must not
    matter: with them scrambled the kernels still produce the reference result."""
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    batch = make_batch([(3, 7), (25, 1)], 4, 2, 64, 32, pad=2, seed=11)
    _, _, ref_out, ref_cache = run_both(batch, spec)
    batch.metadata = replace(batch.metadata, num_actual_tokens=1, num_reqs=1,
                             query_start_loc_cpu=[0, 1], seq_lens_cpu=[1], max_query_len=1,
                             max_seq_len=1, block_size=7)
    out, cache = run_backend(TritonPagedBackend, batch, spec)
    torch.testing.assert_close(out[: ref_out.shape[0]], ref_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, ref_cache)


def test_bfloat16_close_to_reference(interpret):
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    batch = make_batch([(20, 5), (30, 1)], 4, 2, 64, 16, pad=1, seed=3, dtype=torch.bfloat16)
    out, cache, ref_out, ref_cache = run_both(batch, spec)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache, ref_cache)


def test_injected_kernel_config_gives_the_same_result(interpret, monkeypatch):
    from kiln.attention.kernels.attention_kernel import UnifiedAttentionConfig

    spec = AttentionLayerSpec(8, 2, 64, 0.125)
    batch = make_batch([(5, 9), (21, 1), (0, 4)], 8, 2, 64, 16, pad=2, seed=9)
    monkeypatch.setattr(TritonPagedBackend, "kernel_config",
                        UnifiedAttentionConfig(block_m=32, tile_n=16, num_warps=2))
    out, _, ref_out, _ = run_both(batch, spec)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="block_m=8 must be a power of two >= 16"):
        UnifiedAttentionConfig(block_m=8).validate(4)
    with pytest.raises(ValueError, match="num_queries_per_kv=32"):
        UnifiedAttentionConfig(block_m=16).validate(32)


def test_refusals_and_selection(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = TritonPagedBackend.supports(64, torch.float32, CPU)
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    assert select_backend(None, 64, torch.float32, CPU).name in ("cpu", "torch")
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run here"):
        select_backend("triton", 64, torch.float32, CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "head_size 512" in TritonPagedBackend.supports(512, torch.float32, CPU)
    assert "dtype" in TritonPagedBackend.supports(64, torch.int8, CPU)
    if interpreter_reason() is None:  # the session interprets (CPU-only hosts: conftest)
        assert select_backend("triton", 64, torch.float32, CPU) is TritonPagedBackend
    # Automatic choice when the preferred backend refuses: one log line, then the next.
    monkeypatch.setattr(CpuPlatform, "attention_backends", ("triton", "torch"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    selector.logger.addHandler(handler)
    try:
        assert select_backend(None, 512, torch.float32, CPU) is TorchPagedBackend
    finally:
        selector.logger.removeHandler(handler)
    assert len(records) == 1 and "head_size 512" in records[0].getMessage()


def test_greedy_tokens_match_torch_backend(interpret, tiny_models):
    """End to end on a tiny model: mixed prefill chunks and decodes in the same steps. In
    float32: a random tiny model's bf16 logits hold near-ties that any rounding change
    elsewhere in the layer (a fused kernel's one rounding for two) can flip."""
    from kiln import LLM, SamplingParams

    path = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [11, 4, 19], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, progress=False, optimization_level=0, max_model_len=64, max_num_batched_tokens=16,
                  attention_backend=backend, dtype="float32")
        assert llm.engine.runner.attn_backend_cls.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in
                           llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
