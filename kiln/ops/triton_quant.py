"""The quantized linear on CUDA: one Triton dequant-GEMM over kiln's packed formats.

Each program computes a [BM, BN] output tile: per K step it loads x [BM, BK] and the
codes of a [BN, BK] weight tile straight from the packed layout
(kiln/ops/quant_packing.py), dequantizes them in registers (`q * s`, `q * d`,
`q * d + m`, float8 e4m3 decoded from its bits) and accumulates `tl.dot` in fp32 (bf16
and fp16 activations multiply on the tensor cores in their own dtype; fp32 ones in IEEE
fp32, for parity); the per-row scale of INT8 and FP8 applies after the loop. The weight
is never materialised. The tile shape is chosen per row count from `CONFIGS`
(benchmarks/triton_quant.py sweeps them on a GPU). `kiln::linear_quant_cuda` wraps it as a custom op
with a fake, so compiled graphs call it; on a CPU it runs only in Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the tests check it against the reference.
"""
from __future__ import annotations

import torch

# (max rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)): the first entry whose row bound
# covers M. BLOCK_N is a multiple of 16 (a packed row group), BLOCK_K of 32 (a K chunk).
# The first two are the best of benchmarks/triton_quant.py's sweep on an H200 (int8,
# SmolLM2-135M's shapes, 1 and 32 rows); the last (prefill) is not yet swept.
CONFIGS: list[tuple[int, tuple[int, int, int, int]]] = [
    (16, (16, 16, 128, 4)), (64, (16, 32, 128, 4)), (1 << 62, (64, 64, 64, 4))]


def config_for(m: int) -> tuple[int, int, int, int]:
    return next(cfg for bound, cfg in CONFIGS if m <= bound)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_gemm(x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, y_ptr, M, N, K,
                     FMT: tl.constexpr, HAS_BIAS: tl.constexpr, LOW_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        chunks = K // 32
        nb, c = rn // 16, rn % 16
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            kc, kk = rk // 32, rk % 32
            tile = nb[:, None] * chunks + kc[None, :]  # [BN, BK]
            live = (rn[:, None] < N) & (rk[None, :] < K)
            if FMT == 2:
                j = kk[None, :] % 16  # byte (j // 4, c, j % 4) of the tile (linear_quant.h)
                off = tile * 256 + (j // 4) * 64 + c[:, None] * 4 + j % 4
                b = tl.load(codes_ptr + off, mask=live, other=0).to(tl.int32)
                q = tl.where(kk[None, :] < 16, b & 15, b >> 4).to(tl.float32)
            elif FMT == 3:  # e4m3 bits decoded exactly: (8 + m) * 2^(e - 10), m * 2^-9
                off = (tile * 32 + kk[None, :]) * 16 + c[:, None]
                b = tl.load(codes_ptr + off, mask=live, other=0).to(tl.int32)
                e, m = (b >> 3) & 15, b & 7
                mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,
                               (8 + m).to(tl.float32) * tl.exp2((e - 10).to(tl.float32)))
                q = tl.where(b >= 128, -mag, mag)
            else:
                off = (tile * 32 + kk[None, :]) * 16 + c[:, None]
                q = tl.load(codes_ptr + off, mask=live, other=0).to(tl.float32)
            w = q
            if FMT == 1 or FMT == 2:
                soff = tile * 16 + c[:, None]
                w = q * tl.load(scales_ptr + soff, mask=live, other=0.0).to(tl.float32)
                if FMT == 2:
                    w = w + tl.load(mins_ptr + soff, mask=live, other=0.0).to(tl.float32)
            if LOW_PRECISION:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            else:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        if FMT == 0 or FMT == 3:  # one scale per output row
            acc = acc * tl.load(scales_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return dequant_gemm


_compiled: list = []


def _low_precision(dtype: torch.dtype) -> bool:
    """bf16/fp16 dots on the tensor cores; Triton's interpreter computes bf16 tl.dot
    wrongly (see kiln/attention/kernels/attention_kernel.py), so interpreted runs stay fp32."""
    from kiln.ops.triton_runtime import interpreter_requested

    return dtype in (torch.bfloat16, torch.float16) and not interpreter_requested()


@torch.library.custom_op("kiln::linear_quant_cuda", mutates_args=())
def linear_quant_cuda(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None, bias: torch.Tensor | None,
                      fmt: int) -> torch.Tensor:
    """x [M, K] @ dequant(w).T (+ bias) -> [M, N] in x's dtype."""
    if not _compiled:
        _compiled.append(_kernel())
    m, k = x.shape
    n = codes.shape[0] * 16
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps = config_for(m)
    grid = (-(-m // bm), -(-n // bn))
    _compiled[0][grid](x, codes, scales, scales if mins is None else mins,
                       scales if bias is None else bias, y, m, n, k, FMT=fmt,
                       HAS_BIAS=bias is not None,
                       LOW_PRECISION=_low_precision(x.dtype),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


@linear_quant_cuda.register_fake
def _(x, codes, scales, mins, bias, fmt):
    return x.new_empty((x.shape[0], codes.shape[0] * 16))
