"""Pure-PyTorch paged attention: the CPU default and the reference for other backends.

Single-token (decode) rows run as one batched SDPA over their gathered blocks; the other
rows (prefill chunks, possibly with context) loop on the host, lengths coming from the
metadata's CPU mirrors, each with a bottom-right-aligned causal mask.

A sliding window masks keys before p - window + 1 for the query at p, and only the
blocks a row's window reaches are gathered (out-of-window entries of a block table may
be the null block or blocks already handed to another request). A softcap
(cap * tanh(scores / cap), Gemma 2) runs the scores explicitly, as transformers' eager
attention does; SDPA has no softcap.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from kiln.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionLayerSpec,
                                    AttentionMetadata)


@dataclass(slots=True)
class DecodeBatch:
    """The single-token rows of a step, prepared once for every layer."""

    rows: list[int]  # request rows that decode
    tokens: torch.Tensor  # [R] their query token rows
    table: torch.Tensor  # [R, nb] block ids from each row's first block (0 = null block)
    pad: torch.Tensor  # [R, 1, nb * block_size] True where a key is not real or not seen


@dataclass(slots=True)
class TorchPagedMetadata(AttentionMetadata):
    decode: DecodeBatch | None = None


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    # The per-request host loop reads lengths on the host: a captured graph would freeze them.
    cg_support = AttentionCGSupport.NEVER

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype} is not supported (float32, bfloat16, float16 are)"
        return None

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> TorchPagedMetadata:
        qsl = common.query_start_loc_cpu
        rows = [i for i in range(common.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        base = {f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}
        decode = _decode_batch(common, rows, common.sliding_window) if rows else None
        return TorchPagedMetadata(**base, decode=decode)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        if not isinstance(metadata, TorchPagedMetadata):
            metadata = self.build_metadata(metadata)
        s, n = self.spec, metadata.num_actual_tokens
        q = query[:n].view(n, s.num_heads, s.head_size)
        k = key[:n].view(n, s.num_kv_heads, s.head_size)
        v = value[:n].view(n, s.num_kv_heads, s.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, kv_heads, hd]
        write_kv(key_cache, value_cache, k, v, metadata.slot_mapping[:n])
        out = output[:n].view(n, s.num_heads, s.head_size)
        block_size = key_cache.shape[1]
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        decode = metadata.decode
        if decode is not None:
            if metadata.sliding_window != s.sliding_window:  # metadata made for another
                decode = _decode_batch(metadata, decode.rows, s.sliding_window)
            self._batched_decode(q, key_cache, value_cache, decode, out)
        done = set(decode.rows) if decode is not None else set()
        for i in range(metadata.num_reqs):
            if i in done:
                continue
            start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
            first = _first_block(seq_len - (end - start), s.sliding_window, block_size)
            blocks = metadata.block_table[i, first: -(-seq_len // block_size)]
            offset = first * block_size
            keys = _gather(key_cache, blocks, seq_len - offset)  # [kv_heads, len, hd]
            values = _gather(value_cache, blocks, seq_len - offset)
            out[start:end] = _attend(q[start:end].transpose(0, 1), keys, values,
                                     s, seq_len).transpose(0, 1)

    def _batched_decode(self, q: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, decode: DecodeBatch,
                        out: torch.Tensor) -> None:
        """All single-token rows at once over their gathered blocks; the masked tail covers
        shorter contexts and unused table entries (the null block).

        K/V are gathered once (`index_select`, ~3x faster than advanced indexing on a CPU)
        and then read in place: per KV head a strided [R, L, head_size] view feeds `bmm`
        directly, for the group of query heads that share it (GQA), so no transposed or
        per-head copy of the context is made."""
        s = self.spec
        r, group = len(decode.rows), s.num_heads // s.num_kv_heads
        keys = _gather_rows(key_cache, decode.table)  # [R, L, kv_heads, hd]
        values = _gather_rows(value_cache, decode.table)
        query = q[decode.tokens].view(r, s.num_kv_heads, group, s.head_size)
        result = torch.empty_like(query)
        for h in range(s.num_kv_heads):
            scores = torch.bmm(query[:, h], keys[:, :, h].transpose(1, 2))  # [R, G, L]
            scores = _soft_cap(scores * s.scale, s.logits_soft_cap)
            probs = scores.masked_fill(decode.pad, float("-inf")).softmax(
                dim=-1, dtype=torch.float32).to(values.dtype)
            result[:, h] = torch.bmm(probs, values[:, :, h])
        out[decode.tokens] = result.view(r, s.num_heads, s.head_size)


def _decode_batch(md: AttentionMetadata, rows: list[int], window: int | None) -> DecodeBatch:
    """Each row's blocks from the first its window reaches (block 0 without a window),
    shifted to start the table, and the mask of key positions that are not real or out
    of the window."""
    bs, lens = md.block_size, md.seq_lens_cpu
    firsts = [_first_block(lens[i] - 1, window, bs) for i in rows]
    width = max(-(-lens[i] // bs) - f for i, f in zip(rows, firsts))
    idx = torch.tensor(rows, device=md.block_table.device)
    if any(firsts):
        cols = torch.tensor(firsts, device=idx.device).unsqueeze(1) + torch.arange(
            width, device=idx.device)
        cols = cols.clamp(max=md.block_table.shape[1] - 1)
        table = md.block_table[idx.unsqueeze(1), cols].long()
    else:
        table = md.block_table[idx, :width].long()
    first = (torch.tensor(firsts, device=idx.device) * bs).unsqueeze(1)
    pos = first + torch.arange(width * bs, device=idx.device).unsqueeze(0)
    lens = md.seq_lens[idx].unsqueeze(1)
    pad = pos >= lens
    if window is not None:
        pad = pad | (pos < lens - window)
    return DecodeBatch(rows, md.query_start_loc[idx].long(), table, pad[:, None, :])


def _first_block(context_len: int, window: int | None, block_size: int) -> int:
    """The first block a row's window reaches: its first query sits at `context_len`."""
    if window is None:
        return 0
    return max(0, context_len - window + 1) // block_size


def _soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots. A negative slot marks padding: it lands in
    slot 0 of the null block, which no attention ever reads unmasked, so no boolean
    selection (and no host sync for its size) is needed."""
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    slots = slots.clamp(min=0)
    flat_k.index_copy_(0, slots, key)
    flat_v.index_copy_(0, slots, value)


def _gather_rows(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, kv_heads, hd], table [R, nb] -> [R, nb * block_size,
    kv_heads, hd]: every row's blocks in order."""
    r, nb = table.shape
    return cache.index_select(0, table.reshape(-1)).view(r, nb * cache.shape[1],
                                                         *cache.shape[2:])


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    rows = cache.index_select(0, blocks.long()).flatten(0, 1)[:seq_len]  # [seq_len, kvh, hd]
    return rows.transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionLayerSpec,
            seq_len: int) -> torch.Tensor:
    """q: [heads, q_len, hd]; k/v: [kv_heads, n, hd], the last n keys of `seq_len`. Query
    row i sits at absolute position seq_len - q_len + i and sees keys up to it (and, with
    a window, no further back than window - 1 before it)."""
    q_len, n = q.shape[1], k.shape[1]
    qpos = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
    kpos = torch.arange(n, device=q.device).unsqueeze(0) + (seq_len - n)
    mask = None
    if q_len > 1 or spec.sliding_window is not None:
        mask = kpos <= qpos
        if spec.sliding_window is not None:
            mask = mask & (kpos > qpos - spec.sliding_window)
    if spec.logits_soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale,
                                              enable_gqa=q.shape[0] != k.shape[0])
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = _soft_cap(torch.matmul(q, k.transpose(1, 2)) * spec.scale, spec.logits_soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)
