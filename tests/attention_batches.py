"""Random paged-attention batches for backend tests (CPU interpreter and tests/gpu)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata


@dataclass
class Batch:
    query: torch.Tensor  # [T, heads * hd], T includes padding rows
    key: torch.Tensor  # [T, kv_heads * hd]
    value: torch.Tensor
    cache: torch.Tensor  # [2, blocks, block_size, kv_heads, hd], context already written
    metadata: AttentionMetadata
    shapes: list[tuple[int, int]]  # (cached context, new tokens) of each real sequence


def make_batch(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_size: int,
               block_size: int, pad: int, seed: int, dtype: torch.dtype = torch.float32,
               empty_seqs: int = 0, num_blocks: int | None = None,
               max_blocks: int | None = None, device: str = "cpu") -> Batch:
    """`pad` padding token rows (slot -1) and `empty_seqs` trailing sequences with no
    tokens (seq_len 0, null block): the shape of a CUDA graph's padded batch. `num_blocks` /
    `max_blocks` fix the cache and table sizes (graph replay needs equal shapes)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = num_blocks or sum(needed) + 3
    max_blocks = max_blocks or max(needed) + 1
    # Random stale values everywhere (block 0, the null block, included): a kernel that
    # reads a slot it should not would show it.
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(shapes) + empty_seqs, max_blocks, dtype=torch.int32)
    qsl, slots, lens = [0], [], []
    for i, ((ctx, new), nb) in enumerate(zip(shapes, needed)):
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
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    md = AttentionMetadata(
        num_actual_tokens=n, num_reqs=len(lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_query_len=max(new for _, new in shapes), max_seq_len=max(lens),
        block_size=block_size)
    batch = Batch(rand(t, heads * head_size), rand(t, kv_heads * head_size),
                  rand(t, kv_heads * head_size), cache.to(dtype), md, list(shapes))
    return to_device(batch, device)


def to_device(batch: Batch, device: str) -> Batch:
    md = batch.metadata
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(device))
    return Batch(batch.query.to(device), batch.key.to(device), batch.value.to(device),
                 batch.cache.to(device), md, batch.shapes)


def random_shapes(seed: int, num_seqs: int, max_context: int = 60) -> list[tuple[int, int]]:
    """A mix of fresh prefills, chunks with cached context and single-token decodes."""
    g = torch.Generator().manual_seed(seed)

    def r(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    kinds = [lambda: (0, r(1, 20)), lambda: (r(1, max_context), r(2, 12)),
             lambda: (r(0, max_context), 1)]
    return [kinds[i % 3]() for i in range(num_seqs)]


def run_backend(cls: type[AttentionBackend], batch: Batch, spec: AttentionLayerSpec
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output of every row, padding included, NaN where unwritten; the updated cache)."""
    cache = batch.cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    cls(spec).forward(batch.query, batch.key, batch.value, cache,
                      cls.build_metadata(batch.metadata), out)
    return out, cache


def dense_reference(batch: Batch, spec: AttentionLayerSpec) -> torch.Tensor:
    """Each sequence's causal attention, explicitly in float32, over its dense K/V (context
    from the cache, new rows from key/value), independent of any paged code, with the
    spec's window and softcap: [n, heads * hd]."""
    md, d = batch.metadata, spec.head_size
    bs, outs = md.block_size, []
    for i, (ctx, new) in enumerate(batch.shapes):
        start = md.query_start_loc_cpu[i]
        blocks = md.block_table[i, : -(-(ctx + new) // bs)].long()
        k_ctx = batch.cache[0][blocks].flatten(0, 1)[:ctx]  # [ctx, kv_heads, hd]
        v_ctx = batch.cache[1][blocks].flatten(0, 1)[:ctx]
        k = torch.cat([k_ctx, batch.key[start: start + new].view(new, -1, d)])
        v = torch.cat([v_ctx, batch.value[start: start + new].view(new, -1, d)])
        q = batch.query[start: start + new].view(new, -1, d)
        qpos = torch.arange(new, device=q.device).unsqueeze(1) + ctx
        kpos = torch.arange(ctx + new, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if spec.sliding_window is not None:
            mask = mask & (kpos > qpos - spec.sliding_window)
        qf, kf, vf = (x.transpose(0, 1).float() for x in (q, k, v))
        group = qf.shape[0] // kf.shape[0]
        kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
        scores = qf @ kf.transpose(1, 2) * spec.scale
        if spec.logits_soft_cap is not None:
            scores = torch.tanh(scores / spec.logits_soft_cap) * spec.logits_soft_cap
        o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vf
        outs.append(o.transpose(0, 1).reshape(new, -1))
    return torch.cat(outs).to(batch.query.dtype)


def poison_out_of_window(batch: Batch, window: int) -> Batch:
    """Point every block-table entry wholly before a row's window at a NaN block: a
    backend that reads such a block (freed and perhaps reused while serving) shows it."""
    cache = torch.cat([batch.cache, torch.full_like(batch.cache[:, :1], float("nan"))], 1)
    nan_block = cache.shape[1] - 1
    md = batch.metadata
    table = md.block_table.clone()
    for i, (ctx, _) in enumerate(batch.shapes):
        table[i, : max(0, ctx - window + 1) // md.block_size] = nan_block
    md.block_table = table
    return Batch(batch.query, batch.key, batch.value, cache, md, batch.shapes)


def windowed(spec: AttentionLayerSpec, window: int | None,
             softcap: float | None) -> AttentionLayerSpec:
    from dataclasses import replace

    return replace(spec, sliding_window=window, logits_soft_cap=softcap)
