"""The fused-MoE expert GEMMs on CUDA: one Triton kernel over (token, expert) pairs grouped
by expert, launched twice (gate|up, then down).

Alignment (`align_pairs`, device ops only): the T * k (token, slot) pairs are sorted by
expert and each expert's run is padded to a multiple of BLOCK_M with a sentinel pair, so
a program's BLOCK_M rows share one expert; `block_experts[b]` is block b's expert (-1:
a block past the last run, which exits). The buffer sizes are upper bounds that depend
only on T, k and E (T * k + E * (BLOCK_M - 1) rows), never on the routing: nothing is
read back to the host, so a CUDA graph captured once replays for any routing.

    GEMM 1: cache1[p] = x[p // k] @ w13[e]^T                  (p: a pair, e: its expert)
    act:    cache2[p] = silu(gate) * up                        (PyTorch)
    GEMM 2: cache3[p] = weight[p] * (cache2[p] @ w2[e]^T)
    out[t] = sum over t's k pairs of cache3                  (PyTorch)

Accumulation is in fp32; each GEMM's result is rounded once, at the store. On a CPU the
kernel runs only in Triton's interpreter (`TRITON_INTERPRET=1`): tests/test_moe.py
checks it there against the grouped PyTorch loop.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

BLOCK_M = 16


def align_pairs(experts: torch.Tensor, num_experts: int,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P_max] int32, the sentinel T*k where padding; block_experts
    [P_max / block_m] int32) for experts [T, k]."""
    flat = experts.reshape(-1)
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: CUDA's bincount reads its maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    padded_start = torch.cumsum(padded, 0) - padded
    sorted_experts = flat[order]
    rank = torch.arange(n, device=flat.device) - start[sorted_experts]
    total = n + num_experts * (block_m - 1)
    total = -(-total // block_m) * block_m
    pairs = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    pairs[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, total, block_m, device=flat.device)
    padded_end = torch.cumsum(padded, 0)
    block_experts = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return pairs, block_experts


def fused_experts_triton(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, H], weights [T, k] (x's dtype), experts [T, k], w13 [E, 2I, H], w2 [E, H, I]
    -> [T, H], as kiln.moe.op.grouped_experts."""
    t, k = experts.shape
    inter = w2.shape[2]
    pairs, block_experts = align_pairs(experts, w13.shape[0])
    cache1 = x.new_empty((t * k, 2 * inter))
    _launch(x, w13, cache1, pairs, block_experts, None, k)
    cache2 = F.silu(cache1[:, :inter]) * cache1[:, inter:]
    cache3 = x.new_empty((t * k, w2.shape[1]))
    _launch(cache2, w2, cache3, pairs, block_experts, weights.reshape(-1), 1)
    return cache3.view(t, k, -1).sum(dim=1)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor,
            block_experts: torch.Tensor, weights: torch.Tensor | None, a_div: int) -> None:
    from kiln.ops.triton_runtime import interpreter_requested

    kernel = _kernel()
    n, kdim = b.shape[1], b.shape[2]
    block_n, block_k = 32, 32
    grid = (block_experts.numel(), -(-n // block_n))
    kernel[grid](a, b, c, pairs, block_experts, weights if weights is not None else c,
                 c.shape[0], n, kdim, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                 A_DIV=a_div, MUL_WEIGHT=weights is not None, BLOCK_M=BLOCK_M,
                 BLOCK_N=block_n, BLOCK_K=block_k,
                 IEEE=a.dtype == torch.float32 or interpreter_requested(),
                 UPCAST=a.dtype != torch.float32 and interpreter_requested())


_KERNEL: list[Any] = []


def _kernel() -> Any:
    """The jitted kernel, built at the first launch (selecting paths imports no Triton)."""
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def moe_gemm(a_ptr, b_ptr, c_ptr, pairs_ptr, block_experts_ptr, w_ptr, num_pairs, N, K,
                 a_stride, b_stride_e, b_stride_n, c_stride, A_DIV: tl.constexpr,
                 MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:
            return
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        row_ok = pair < num_pairs  # the sentinel pads the expert's last block
        a_row = (pair // A_DIV).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        b_base = b_ptr + expert.to(tl.int64) * b_stride_e
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            offs_k = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + a_row[:, None] * a_stride + offs_k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + offs_n[None, :] * b_stride_n + offs_k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:  # the interpreter computes bf16 dots wrongly
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if MUL_WEIGHT:
            w = tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    _KERNEL.append(moe_gemm)
    return moe_gemm
