"""Triton kernel that scatters this step's K/V rows into the paged cache.

Program (t, h) copies token t's head h of K and of V to slot `slot_mapping[t]`
(block = slot // block_size, offset = slot % block_size); a negative slot marks a padding
row and the program returns without writing. The grid is the padded token count, a tensor
shape, so a captured CUDA graph replays it correctly for any slot values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class KVWriteConfig:
    """Launch parameters of the write kernel (memory-bound: a few warps suffice)."""

    num_warps: int = 1


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             config: KVWriteConfig | None = None) -> None:
    """key/value: [T, num_kv_heads, head_size]; caches: [num_blocks, block_size,
    num_kv_heads, head_size]; slot_mapping: [>= rows to write] int, -1 = skip.

    Rows past `slot_mapping`'s length are not written (the runner may pass it unpadded)."""
    num_tokens = min(key.shape[0], slot_mapping.shape[0])
    _, block_size, num_kv_heads, head_size = key_cache.shape
    cfg = config or KVWriteConfig()
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        HEAD_SIZE=head_size, HEAD_PAD=1 << (head_size - 1).bit_length(),
        PAGE_SIZE=block_size, num_warps=cfg.num_warps)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     kc_stride_b, kc_stride_s, kc_stride_h,
                     vc_stride_b, vc_stride_s, vc_stride_h,
                     HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                     PAGE_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    k = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + offs_d, mask=d_ok)
    v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + offs_d, mask=d_ok)
    tl.store(k_cache_ptr + block * kc_stride_b + in_page * kc_stride_s + head * kc_stride_h
             + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=d_ok)
    tl.store(v_cache_ptr + block * vc_stride_b + in_page * vc_stride_s + head * vc_stride_h
             + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_ok)
