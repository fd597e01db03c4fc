"""The Triton backend against the PyTorch reference, on the CPU under TRITON_INTERPRET=1.

The interpreter runs each kernel program in numpy: correct but slow, so shapes stay small.
tests/conftest.py sets TRITON_INTERPRET=1 at session start on hosts without CUDA (it must
precede Triton's first import); with CUDA these tests skip and tests/gpu/ runs the kernels.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from conftest import random_prompts
from kiln.attention import AttentionLayerSpec, AttentionMetadata, select_backend
from kiln.attention import selector
from kiln.attention.backends import TorchPagedBackend, TritonPagedBackend

pytest.importorskip("triton")

CPU = torch.device("cpu")


@pytest.fixture
def interpret() -> None:
    from kiln.attention.kernels import interpreter_reason

    reason = interpreter_reason()
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Batch:
    query: torch.Tensor  # [T, heads * hd], T includes padding rows
    key: torch.Tensor  # [T, kv_heads * hd]
    value: torch.Tensor
    cache: torch.Tensor  # [2, blocks, block_size, kv_heads, hd], context already written
    metadata: AttentionMetadata


def make_batch(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_size: int,
               block_size: int, pad: int, seed: int, dtype: torch.dtype = torch.float32,
               empty_seqs: int = 0) -> Batch:
    """shapes: (cached context, new tokens) per sequence. `empty_seqs` trailing sequences
    with no tokens model a CUDA graph's padded request rows (seq_len 0, null block)."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(blocks_needed) + 3
    max_blocks = max(blocks_needed) + 1
    # Random stale values everywhere (block 0, the null block, included): a kernel that
    # reads a slot it should not would show it.
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(shapes) + empty_seqs, max_blocks, dtype=torch.int32)
    qsl, slots, lens = [0], [], []
    for i, ((ctx, new), nb) in enumerate(zip(shapes, blocks_needed)):
        table[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        slots += [int(table[i, p // block_size]) * block_size + p % block_size
                  for p in range(ctx, ctx + new)]
        qsl.append(qsl[-1] + new)
        lens.append(ctx + new)
    qsl += [qsl[-1]] * empty_seqs
    lens += [0] * empty_seqs
    n = qsl[-1]
    t = n + pad
    query = torch.randn(t, heads * head_size, generator=g)
    key = torch.randn(t, kv_heads * head_size, generator=g)
    value = torch.randn(t, kv_heads * head_size, generator=g)
    md = AttentionMetadata(
        num_actual_tokens=n, num_reqs=len(lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_query_len=max(new for _, new in shapes), max_seq_len=max(lens),
        block_size=block_size)
    return Batch(query.to(dtype), key.to(dtype), value.to(dtype), cache.to(dtype), md)


def run_both(batch: Batch, spec: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    """(triton output, triton cache, reference output, reference cache); outputs cut to
    the real rows."""
    n = batch.metadata.num_actual_tokens
    outs, caches = [], []
    for cls in (TritonPagedBackend, TorchPagedBackend):
        cache = batch.cache.clone()
        out = torch.full_like(batch.query, float("nan"))
        cls(spec).forward(batch.query, batch.key, batch.value, cache,
                          cls.build_metadata(batch.metadata), out)
        outs.append(out[:n])
        caches.append(cache)
    return outs[0], caches[0], outs[1], caches[1]


def random_shapes(seed: int, num_seqs: int) -> list[tuple[int, int]]:
    """A mix of fresh prefills, chunks with cached context and single-token decodes."""
    g = torch.Generator().manual_seed(seed)
    shapes = []
    for i in range(num_seqs):
        kind = i % 3
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        shapes.append([(0, r(1, 20)), (r(1, 40), r(2, 12)), (r(0, 60), 1)][kind])
    return shapes


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
    out, cache, _, _ = run_both_triton_only(padded, spec)
    _, _, ref_out, ref_cache = run_both(plain, spec)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(cache, ref_cache)


def run_both_triton_only(batch: Batch, spec: AttentionLayerSpec):
    n = batch.metadata.num_actual_tokens
    cache = batch.cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    TritonPagedBackend(spec).forward(batch.query, batch.key, batch.value, cache,
                                     batch.metadata, out)
    assert out[n:].isnan().all()  # padding rows are never written
    return out[:n], cache, None, None


def test_bfloat16_close_to_reference(interpret):
    spec = AttentionLayerSpec(4, 2, 64, 0.125)
    batch = make_batch([(20, 5), (30, 1)], 4, 2, 64, 16, pad=1, seed=3, dtype=torch.bfloat16)
    out, cache, ref_out, ref_cache = run_both(batch, spec)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(cache, ref_cache)


def test_injected_kernel_config_gives_the_same_result(interpret, monkeypatch):
    from kiln.attention.kernels import UnifiedAttentionConfig

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
    assert select_backend(None, 64, torch.float32, CPU) is TorchPagedBackend
    with pytest.raises(ValueError, match=r"attention_backend='triton' cannot run here"):
        select_backend("triton", 64, torch.float32, CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "head_size 512" in TritonPagedBackend.supports(512, torch.float32, CPU)
    assert "dtype" in TritonPagedBackend.supports(64, torch.int8, CPU)
    assert select_backend("triton", 64, torch.float32, CPU) is TritonPagedBackend
    # Automatic choice when the preferred backend refuses: one log line, then the next.
    monkeypatch.setitem(selector.PREFERENCE, "cpu", ("triton", "torch"))
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
    """End to end on a tiny model: mixed prefill chunks and decodes in the same steps."""
    from kiln import LLM, SamplingParams

    path = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [11, 4, 19], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, progress=False, max_model_len=64, max_num_batched_tokens=16,
                  attention_backend=backend)
        assert llm.engine.runner.attn_backend_cls.name == backend
        tokens[backend] = [o.outputs[0].token_ids for o in
                           llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
