"""The PyTorch and C++ (cpu) paged backends against dense causal attention, and the opaque
op's contract."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionLayerSpec, AttentionMetadata
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.forward_context import (ForwardContext, get_forward_context,
                                            set_forward_context)
from kiln.ops import cpu_paths


def dense_reference(q, k, v, scale):
    """q: [L, H, D] all positions of one sequence; causal; GQA by repeating K/V."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


@pytest.fixture(params=["torch", "cpu"])
def backend_cls(request):
    if request.param == "cpu":
        request.getfixturevalue("cpu_kernels_loaded")
        return CpuPagedBackend
    return TorchPagedBackend


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 16), (8, 2, 16), (6, 1, 32)])
def test_mixed_prefill_and_decode_batch_with_padding(heads, kv_heads, block_size, backend_cls):
    torch.manual_seed(0)
    D, num_blocks = 16, 40
    spec = AttentionLayerSpec(heads, kv_heads, D, D ** -0.5)
    backend = backend_cls(spec)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, D)
    # (context already cached, new tokens): a fresh prefill, a chunk with context, decodes,
    # and a verify step's few tokens after a longer context (the cpu backend splits those
    # into decode rows, each with its causal length).
    shapes = [(0, 13), (20, 7), (37, 1), (5, 1), (30, 3)]
    perm = torch.randperm(num_blocks - 1) + 1  # scattered physical blocks, never block 0
    seqs, tables, next_block = [], [], 0
    for ctx, new in shapes:
        total = ctx + new
        nb = -(-total // block_size)
        tables.append(perm[next_block: next_block + nb])
        next_block += nb
        seqs.append((torch.randn(total, heads, D), torch.randn(total, kv_heads, D),
                     torch.randn(total, kv_heads, D)))
    # Write each sequence's context into the cache as earlier steps would have.
    for (ctx, _), (q, k, v), table in zip(shapes, seqs, tables):
        for p in range(ctx):
            blk, off = table[p // block_size], p % block_size
            cache[0, blk, off], cache[1, blk, off] = k[p], v[p]
    pad = 3
    q_rows, k_rows, v_rows, slots, qsl = [], [], [], [], [0]
    for (ctx, new), (q, k, v), table in zip(shapes, seqs, tables):
        q_rows.append(q[ctx:]), k_rows.append(k[ctx:]), v_rows.append(v[ctx:])
        slots += [int(table[p // block_size]) * block_size + p % block_size
                  for p in range(ctx, ctx + new)]
        qsl.append(qsl[-1] + new)
    n = qsl[-1]
    query = torch.cat(q_rows + [torch.randn(pad, heads, D)]).reshape(n + pad, -1)
    key = torch.cat(k_rows + [torch.randn(pad, kv_heads, D)]).reshape(n + pad, -1)
    value = torch.cat(v_rows + [torch.randn(pad, kv_heads, D)]).reshape(n + pad, -1)
    table = torch.zeros(len(shapes), 8, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    seq_lens = [c + n_ for c, n_ in shapes]
    md = AttentionMetadata(
        num_actual_tokens=n, num_reqs=len(shapes),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots + [-1] * pad), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens, max_query_len=13, max_seq_len=max(seq_lens),
        block_size=block_size)
    before_null = cache[:, 0].clone()
    output = torch.full_like(query, float("nan"))
    backend.forward(query, key, value, cache, md, output)
    for i, ((ctx, new), (q, k, v)) in enumerate(zip(shapes, seqs)):
        expected = dense_reference(q, k, v, spec.scale)[ctx:]
        got = output[qsl[i]: qsl[i + 1]].view(new, heads, D)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[:, 0], before_null)  # padding rows (slot -1) wrote nothing


def test_forward_context_refuses_nesting_and_absence():
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    ctx = ForwardContext(None, [], [])
    with set_forward_context(ctx):
        assert get_forward_context() is ctx
        with pytest.raises(RuntimeError, match="do not nest"):
            with set_forward_context(ctx):
                pass
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_attention_op_is_opaque_to_dynamo():
    """Dynamo records the op as one node and never traces into the backend."""
    from kiln.attention.layer import Attention

    layer = Attention(4, 2, 8, 8 ** -0.5, layer_index=0)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda q, k, v: layer(q, k, v) * 2, backend=backend, fullgraph=True)
    q, kv = torch.randn(3, 32), torch.randn(3, 16)
    with set_forward_context(ForwardContext(None, [], [])):
        fn(q, kv, kv)
    assert torch.ops.kiln.unified_attention.default in seen


@pytest.mark.parametrize("heads,kv_heads,D,dtype", [(9, 3, 64, torch.bfloat16),
                                                    (8, 2, 16, torch.float32),
                                                    (6, 1, 32, torch.float32)])
@pytest.mark.parametrize("ctx", [70, 254])
def test_verify_rows_equal_the_same_tokens_decoded_one_by_one(heads, kv_heads, D, dtype, ctx,
                                                              cpu_kernels_loaded):
    """The cpu backend attends a verify step's 1 + k tokens together (each key and value
    row read once for all of them), its keys cut into fixed chunks whose partial results
    are merged; every token's result must be bit for bit what it gets as a lone decode row
    with its causal length. At 254 the tokens see 255-259 keys: two chunks for some, three
    for others."""
    torch.manual_seed(0)
    block_size, new = 16, 5
    n_blocks = (ctx + new) // block_size + 1
    spec = AttentionLayerSpec(heads, kv_heads, D, D ** -0.5)
    backend = CpuPagedBackend(spec)
    cache = torch.randn(2, n_blocks + 4, block_size, kv_heads, D).to(dtype)
    table = torch.randperm(n_blocks + 3, dtype=torch.int32)[None, :n_blocks] + 1
    q = torch.randn(new, heads * D).to(dtype)
    k, v = (torch.randn(new, kv_heads * D).to(dtype) for _ in range(2))
    slots = [int(table[0, p // block_size]) * block_size + p % block_size
             for p in range(ctx, ctx + new)]

    def run(qsl: list[int], lens: list[int], rows: torch.Tensor) -> torch.Tensor:
        md = AttentionMetadata(
            num_actual_tokens=new, num_reqs=len(lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=rows,
            slot_mapping=torch.tensor(slots), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])), max_seq_len=max(lens),
            block_size=block_size)
        out = torch.full_like(q, float("nan"))
        backend.forward(q, k, v, cache, md, out)
        return out

    together = run([0, new], [ctx + new], table)
    alone = run(list(range(new + 1)), [ctx + 1 + j for j in range(new)], table.repeat(new, 1))
    assert not together.isnan().any()
    assert torch.equal(together, alone)


def test_bf16_prefill_kernel_keeps_scores_far_below_the_max(cpu_kernels_loaded):
    """Scores more than 126 octaves below their row's max weigh nothing; the kernel's exp
    must not wrap there (AVX2 builds scale by exponent bits). Large queries make every
    row's softmax nearly one-hot, its other scores far below the max."""
    import dataclasses

    from attention_batches import dense_reference, make_batch, run_backend

    spec = AttentionLayerSpec(4, 2, 64, 64 ** -0.5)
    batch = make_batch([(0, 100), (60, 40)], 4, 2, 64, 16, pad=0, seed=5,
                       dtype=torch.bfloat16)
    batch = dataclasses.replace(batch, query=batch.query * 300)
    expected = dense_reference(batch, spec).float()
    got = run_backend(CpuPagedBackend, batch, spec)[0][:expected.shape[0]].float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("heads,kv_heads,D,block_size,window,softcap", [
    (9, 3, 64, 16, None, None), (8, 1, 128, 32, 37, None), (6, 2, 48, 16, None, 5.0),
    (4, 4, 16, 16, 20, 3.0)])
def test_bf16_prefill_kernel_matches_dense_attention(heads, kv_heads, D, block_size, window,
                                                     softcap, cpu_kernels_loaded):
    """The cpu backend's tiled bf16 prefill kernel (csrc/attention_prefill.h) against
    float32 dense attention at bf16's tolerance, as close as SDPA over the gathered blocks
    (the path it replaced, still behind `set_prefill_kernel(False)`): a prompt longer than
    one 512-key chunk, chunks after a cached prefix (one crossing a chunk boundary), short
    prompts and a decode row beside them; GQA groups 1 to 8; with a window the blocks
    before every row's window are NaN, so reading one would show. On AMX hosts the
    tiles' path and the registers' are both checked."""
    from attention_batches import (dense_reference, make_batch, poison_out_of_window,
                                   run_backend, windowed)

    spec = windowed(AttentionLayerSpec(heads, kv_heads, D, D ** -0.5), window, softcap)
    shapes = [(0, 600), (70, 50), (0, 37), (500, 40), (5, 1)]
    batch = make_batch(shapes, heads, kv_heads, D, block_size, pad=3, seed=2,
                       dtype=torch.bfloat16)
    expected = dense_reference(batch, spec).float()
    if window is not None:
        batch = poison_out_of_window(batch, window)
    n = expected.shape[0]
    kernel = run_backend(CpuPagedBackend, batch, spec)[0][:n].float()
    if cpu_paths.amx_active():  # the tiles ran (D % 32 == 0): the registers' path too
        try:
            torch.ops.kiln_cpu.set_amx(False, 1)
            regs = run_backend(CpuPagedBackend, batch, spec)[0][:n].float()
        finally:
            cpu_paths.set_amx_from(cpu_paths.amx_from())
        assert torch.equal(regs, kernel) == (D % 32 != 0)
        torch.testing.assert_close(regs, expected, atol=1.6e-2, rtol=1.6e-2)
    torch.ops.kiln_cpu.set_prefill_kernel(False)
    try:
        sdpa = run_backend(CpuPagedBackend, batch, spec)[0][:n].float()
    finally:
        torch.ops.kiln_cpu.set_prefill_kernel(True)
    assert not torch.equal(kernel, sdpa)  # the switch really changes the path
    err, err_sdpa = ((x - expected).abs().max().item() for x in (kernel, sdpa))
    assert err <= max(1.6e-2, 1.5 * err_sdpa), (err, err_sdpa)
    torch.testing.assert_close(kernel, expected, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_reads_qkv_columns_of_one_fused_output_in_place(dtype, cpu_kernels_loaded):
    """A model hands the op q, k and v as column ranges of its QKV projection's output
    (rows strided by the fused width; kiln.models.llama): the cache is written from those
    rows in place and every output is the one contiguous copies give, prefill and decode
    rows, with padding (slot -1) writing nothing."""
    from dataclasses import replace

    from attention_batches import make_batch, run_backend

    heads, kv_heads, D = 6, 2, 32
    spec = AttentionLayerSpec(heads, kv_heads, D, D ** -0.5)
    batch = make_batch([(0, 40), (20, 7), (33, 1)], heads, kv_heads, D, 16, pad=2, seed=4,
                       dtype=dtype)
    fused = torch.cat([batch.query, batch.key, batch.value], dim=1)
    q, k, v = fused.split([heads * D, kv_heads * D, kv_heads * D], dim=1)
    assert not k.is_contiguous() and not v.is_contiguous()
    expected_out, expected_cache = run_backend(CpuPagedBackend, batch, spec)
    out, cache = run_backend(CpuPagedBackend, replace(batch, query=q, key=k, value=v), spec)
    assert torch.equal(cache, expected_cache)
    assert torch.equal(out.nan_to_num(), expected_out.nan_to_num())  # padding rows: NaN
