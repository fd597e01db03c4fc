"""Pure-PyTorch paged attention: the CPU default and the reference for other backends.

Loops over requests on the host (lengths come from the metadata's CPU mirrors), gathers
each request's K/V from its blocks and runs SDPA with a bottom-right-aligned causal mask,
so prefill chunks with context and single-token decodes mix in one batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    # The per-request host loop reads lengths on the host: a captured graph would freeze them.
    cg_support = AttentionCGSupport.NEVER

    @classmethod
    def supports(cls, head_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"dtype {dtype} is not supported (float32, bfloat16, float16 are)"
        return None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        s, n = self.spec, metadata.num_actual_tokens
        q = query[:n].view(n, s.num_heads, s.head_size)
        k = key[:n].view(n, s.num_kv_heads, s.head_size)
        v = value[:n].view(n, s.num_kv_heads, s.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, kv_heads, hd]
        write_kv(key_cache, value_cache, k, v, metadata.slot_mapping[:n])
        out = output[:n].view(n, s.num_heads, s.head_size)
        block_size = key_cache.shape[1]
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
            blocks = metadata.block_table[i, : -(-seq_len // block_size)]
            keys = _gather(key_cache, blocks, seq_len)  # [kv_heads, seq_len, hd]
            values = _gather(value_cache, blocks, seq_len)
            out[start:end] = _attend(q[start:end].transpose(0, 1), keys, values,
                                     s.scale).transpose(0, 1)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots; a negative slot marks padding and is skipped."""
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    valid = slots >= 0
    flat_k[slots[valid]] = key[valid]
    flat_v[slots[valid]] = value[valid]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    rows = cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, hd]
    return rows.transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [heads, q_len, hd]; k/v: [kv_heads, seq_len, hd]. Query row i sits at absolute
    position seq_len - q_len + i and sees keys 0..that position."""
    q_len, seq_len = q.shape[1], k.shape[1]
    mask = None
    if q_len > 1:
        offset = seq_len - q_len
        qpos = torch.arange(q_len, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= qpos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[0] != k.shape[0])
