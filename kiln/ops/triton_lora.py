"""The batched LoRA op on CUDA: two Triton kernels behind `kiln::lora_add_`.

    shrink, grid (T, cdiv(NR, BLOCK_R)):  h[t, r] = x[t] . A_s[r]                 (fp32)
    expand, grid (T, cdiv(out, BLOCK_N)): out[t, n] = y[t, n] + scaling[s] * h[t] . B_s[n]
with s = indices[t] and A_s, B_s^T slot s's rows of `lora_a` and `lora_b` (B stored
transposed; kiln/ops/lora.py has the layout). Products accumulate in fp32 and h stays fp32 between
the kernels, so a half-precision result is rounded once, at the store.

Two kernels, not one fused: a fused program per (token, output block) would recompute
x[t] @ A_s^T (NR x in multiply-adds, the larger half of the work) once per output block,
cdiv(out, BLOCK_N) times per token; a fused program per token instead would leave a decode
step (a few tokens) with a few programs for the whole `out` dimension. The fp32 scratch h
costs T * NR * 4 bytes and one extra launch.

Per-token programs rather than `tl.dot` over token tiles: tokens of one tile may use
different slots, and grouping them by slot (SGMV) needs a sort of the indices; at decode
sizes, where LoRA's overhead over the base GEMM matters most, a tile is mostly one token
anyway. Tokens of one slot read the same A/B rows, which L2 shares between their programs.

Graph safety: no host synchronisation (nothing reads a device value on the host) and a
grid that depends only on shapes (T, NR, out), never on the indices' values. Each program
reads its token's slot on the device; a slot outside [0, S) (-1: no adapter) masks every
adapter load, so its row is y's exact values and nothing outside the slot tables is read.
A CUDA graph captured once therefore replays for any adapter mix, and for slot contents,
scalings and indices written in place.

Importing this module registers the kernel for CUDA tensors (kiln/ops/lora.py imports it
where torch has CUDA and Triton is installed); Triton itself is imported at the first
launch, as in kiln/ops/triton_quant.py. On a CPU the kernels run only in Triton's
interpreter (`TRITON_INTERPRET=1`): that is how tests/test_lora_triton.py checks them.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

# Untuned defaults: a [BLOCK_R, BLOCK_K] tile of A and a [BLOCK_N, BLOCK_R] tile of B are
# 2048 and 1024 elements, a comfortable register load for 4 warps. BLOCK_R also bounds the
# wasted lanes when NR is not a power of two (NR is looped or gridded over, never padded).
BLOCK_R, BLOCK_K, BLOCK_N = 16, 128, 64


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """(shrink, expand), built at the first launch so importing kiln never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(x_ptr, a_ptr, idx_ptr, h_ptr, S, NR, K, stride_xt, stride_xk, stride_ar,
               stride_ak, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # int64: t * stride can pass 2^31 in a prefill
        s = tl.load(idx_ptr + t)
        live = (s >= 0) & (s < S)
        slot = tl.where(live, s, 0)  # never form an address outside the table
        # A dead row masks by a zero extent, not `mask & live`: Triton 3.9's interpreter
        # splats a scalar bool to an integer array, which loads reject as a mask.
        live_k = tl.where(live, K, 0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < NR
        a_rows = a_ptr + (slot * NR + r)[:, None] * stride_ar  # [BLOCK_R, 1]
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < live_k
            xv = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=kmask,
                         other=0.0).to(tl.float32)  # [BLOCK_K]
            av = tl.load(a_rows + k[None, :] * stride_ak, mask=rmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_K]
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(h_ptr + t * NR + r, acc, mask=r < NR)

    @triton.jit
    def expand(y_ptr, h_ptr, b_ptr, scaling_ptr, idx_ptr, out_ptr, S, NR, N, stride_yt,
               stride_yn, stride_bn, stride_br, stride_ot, stride_on,
               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        s = tl.load(idx_ptr + t)
        live = (s >= 0) & (s < S)
        slot = tl.where(live, s, 0)
        live_r = tl.where(live, NR, 0)  # a zero extent masks a dead row (see shrink)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, NR, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rmask = r < live_r
            hv = tl.load(h_ptr + t * NR + r, mask=rmask, other=0.0)  # [BLOCK_R] fp32
            bv = tl.load(b_ptr + n[:, None] * stride_bn + (slot * NR + r)[None, :] * stride_br,
                         mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(bv * hv[None, :], axis=1)  # [BLOCK_N]
        yv = tl.load(y_ptr + t * stride_yt + n * stride_yn, mask=nmask, other=0.0)
        scale = tl.load(scaling_ptr + slot)
        # PEFT's order: (x @ A^T) @ B^T, times scaling, added to y; a row without an
        # adapter is y bit for bit (y + 0 would turn -0.0 into +0.0).
        res = tl.where(live, (yv.to(tl.float32) + acc * scale).to(yv.dtype), yv)
        tl.store(out_ptr + t * stride_ot + n * stride_on, res, mask=nmask)

    return shrink, expand


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           scaling: torch.Tensor, indices: torch.Tensor) -> None:
    """The layout contract, from shapes and dtypes only (no device reads)."""
    T, K = x.shape
    S = scaling.shape[0]
    if y.shape[0] != T or {y.dtype, lora_a.dtype, lora_b.dtype} != {x.dtype}:
        raise ValueError(f"y {tuple(y.shape)} {y.dtype}, lora_a {lora_a.dtype} and lora_b "
                         f"{lora_b.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if S == 0 or lora_a.shape[0] % S or lora_a.shape[1] != K:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} must be [S * NR, {K}] with S={S}")
    if tuple(lora_b.shape) != (lora_a.shape[0], y.shape[1]):
        raise ValueError(f"lora_b (B^T) {tuple(lora_b.shape)} must be [{lora_a.shape[0]}, "
                         f"{y.shape[1]}]")
    if scaling.dtype != torch.float32 or indices.shape[0] < T:
        raise ValueError(f"scaling must be float32 (is {scaling.dtype}) and indices hold "
                         f">= {T} entries (holds {indices.shape[0]})")


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, scaling: torch.Tensor, indices: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """y plus each token's LoRA update (kiln/ops/lora.py) by the two Triton kernels, into
    `out` (a new tensor like y by default; `out=y` is the in-place op: each expand
    program reads its elements of y before it writes the same elements).

    y, x, lora_a and lora_b may have any strides (Triton specialises unit strides, so
    contiguous ones load vectorised); scaling and indices are read as dense vectors, and
    only the first T = x.shape[0] indices are read.
    """
    _check(y, x, lora_a, lora_b, scaling, indices)
    out = torch.empty_like(y) if out is None else out
    T, K = x.shape
    if T == 0:
        return out
    S = scaling.shape[0]
    NR = lora_a.shape[0] // S
    N = y.shape[1]
    h = torch.empty((T, NR), dtype=torch.float32, device=x.device)  # [T, NR]
    shrink, expand = _kernels()
    shrink[(T, _cdiv(NR, BLOCK_R))](
        x, lora_a, indices, h, S, NR, K, x.stride(0), x.stride(1), lora_a.stride(0),
        lora_a.stride(1), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    expand[(T, _cdiv(N, BLOCK_N))](
        y, h, lora_b, scaling, indices, out, S, NR, N, y.stride(0), y.stride(1),
        lora_b.stride(1), lora_b.stride(0), out.stride(0), out.stride(1),  # B^T: (n, r)
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.register_kernel("kiln::lora_add_", "cuda")
def _lora_add_cuda(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scaling: torch.Tensor, indices: torch.Tensor) -> None:
    lora_apply_triton(y, x, lora_a, lora_b, scaling, indices, out=y)
