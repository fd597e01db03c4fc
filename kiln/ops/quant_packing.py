"""Quantized weight layouts: kiln's kernel formats, built once at load, and their exact
dequantization (the reference every kernel is tested against, and the fallback where no
kernel runs).

A `QuantWeight` holds one linear's weight [N, K] in one of three formats (the layouts
are spelled out in kiln/ops/csrc/linear_quant.h):
- INT8: int8 codes, one fp32 scale per output row (weight-only int8, made at load);
- Q8:   int8 codes, an fp16 scale per row and 32-column group (GGUF Q8_0);
- Q4:   4-bit codes, fp16 scale and offset per row and group (GGUF Q4_1; Q4_0 is Q4_1
        with offset -8 * scale, exact in fp16);
- FP8:  float8 e4m3 codes (stored as their bytes), one fp32 scale per output row (CUDA's
        Triton kernel; on a CPU only the reference runs it).
Codes are stored tiled by 16 rows and 32 columns so the kernel streams each tile once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT8, Q8, Q4, FP8 = 0, 1, 2, 3
FORMAT_NAMES = {INT8: "int8", Q8: "q8_0", Q4: "q4", FP8: "fp8"}
GROUP = 32  # K columns per scale group in Q8 and Q4 (GGUF's block size)


@dataclass(slots=True)
class QuantWeight:
    """One packed weight: `codes` [N/16, K/32, bytes per tile], `scales` (fp32 [N] for
    INT8, fp16 [N/16, K/32, 16] otherwise), `mins` (Q4 only, like the scales)."""

    fmt: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * 16, self.codes.shape[1] * 32

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.codes, self.scales, self.mins) if t is not None)


def packable_shape(n: int, k: int) -> bool:
    return n % 16 == 0 and k % GROUP == 0 and n > 0 and k > 0


def _tile(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 32, 16]: tile[nb, kc, kk, c] = q[16 nb + c, 32 kc + kk]."""
    n, k = q.shape
    return q.view(n // 16, 16, k // 32, 32).permute(0, 2, 3, 1)


def _untile(t: torch.Tensor) -> torch.Tensor:
    nb, kc = t.shape[:2]
    return t.permute(0, 3, 1, 2).reshape(nb * 16, kc * 32)


def _group_tile(s: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, K/32] -> [N/16, K/32, 16]."""
    n, g = s.shape
    return s.view(n // 16, 16, g).permute(0, 2, 1).contiguous()


def _group_untile(t: torch.Tensor) -> torch.Tensor:
    nb, g = t.shape[:2]
    return t.permute(0, 2, 1).reshape(nb * 16, g)


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> QuantWeight:
    """int8 codes [N, K] and fp32 per-row scales [N]."""
    n, k = q.shape
    codes = _tile(q.to(torch.int8)).reshape(n // 16, k // 32, 512).contiguous()
    return QuantWeight(INT8, codes, scales.to(torch.float32).contiguous())


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> QuantWeight:
    """int8 codes [N, K] and fp16 group scales [N, K/32]."""
    n, k = q.shape
    codes = _tile(q.to(torch.int8)).reshape(n // 16, k // 32, 512).contiguous()
    return QuantWeight(Q8, codes, _group_tile(d.to(torch.float16)))


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QuantWeight:
    """Codes 0..15 [N, K] (uint8), fp16 group scales and offsets [N, K/32]."""
    n, k = q.shape
    t = _tile(q.to(torch.uint8))  # [nb, kc, 32, 16]
    b = t[:, :, :16] | (t[:, :, 16:] << 4)  # [nb, kc, j, c]: codes j and j + 16
    # Four adjacent j of one column side by side ([nb, kc, j // 4, c, j % 4]): each 32-bit
    # lane then holds one column's 4 k, as the VNNI dot product (`vpdpbusd`) takes them.
    codes = b.view(n // 16, k // 32, 4, 4, 16).transpose(3, 4).reshape(n // 16, k // 32, 256)
    codes = codes.contiguous()
    return QuantWeight(Q4, codes, _group_tile(d.to(torch.float16)),
                       _group_tile(m.to(torch.float16)))


def pack_q4_bytes(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QuantWeight:
    """GGUF's own 4-bit bytes [N, K/2] (byte j of a 32-column group holds codes j and
    j + 16, the pairing of kiln's Q4 tile bytes), fp16 group scales and offsets [N, K/32]:
    `pack_q4`'s result in one permuting copy, with no codes unpacked (a third of the
    default model's repacking at each start)."""
    n, groups = qs.shape[0], qs.shape[1] // 16
    # [nb, c, kc, j // 4, j % 4] -> [nb, kc, j // 4, c, j % 4], as pack_q4 lays them out.
    codes = qs.view(n // 16, 16, groups, 4, 4).permute(0, 2, 3, 1, 4)
    return QuantWeight(Q4, codes.reshape(n // 16, groups, 256),
                       _group_tile(d.to(torch.float16)), _group_tile(m.to(torch.float16)))


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the direct Q4 kernel of AVX512-BF16 and AVX2 builds sees it (llama.cpp's
    Q8_1 scheme): each row's 32-column chunks quantized to int8, s = max|x| / 127,
    q = round(x / s), returned dequantized (q * s) in fp32. The kernel's reference."""
    m, k = x.shape
    g = x.detach().to(torch.float32).view(m, k // GROUP, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp_(-127, 127)
    return (q * (amax / 127.0)).view(m, k)


def quantize_fp8(weight: torch.Tensor) -> QuantWeight:
    """float8 e4m3 per output row: s = max|w| / 448 (e4m3's largest finite value), codes
    = e4m3(w / s), rounded to nearest by torch's cast."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    scales = w.abs().amax(dim=1) / 448.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (w / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantWeight(FP8, _tile(codes).reshape(n // 16, k // 32, 512).contiguous(), scales)


def unpack_codes(w: QuantWeight) -> torch.Tensor:
    """The integer codes [N, K] (int16, so every format fits)."""
    nb, kc = w.codes.shape[:2]
    if w.fmt == Q4:
        b = w.codes.view(nb, kc, 4, 16, 4).transpose(3, 4).reshape(nb, kc, 16, 16)
        t = torch.cat((b & 15, b >> 4), dim=2)
        return _untile(t).to(torch.int16)
    return _untile(w.codes.view(nb, kc, 32, 16)).to(torch.int16)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the kernels compute with: q * s (INT8), q * d (Q8), q * d + m
    (Q4), in fp32, then cast to `dtype`."""
    if w.fmt == FP8:
        nb, kc = w.codes.shape[:2]
        codes = _untile(w.codes.view(nb, kc, 32, 16)).contiguous()
        return (codes.view(torch.float8_e4m3fn).float() * w.scales[:, None]).to(dtype)
    q = unpack_codes(w).to(torch.float32)
    if w.fmt == INT8:
        out = q * w.scales[:, None]
    else:
        d = _group_untile(w.scales).to(torch.float32).repeat_interleave(GROUP, dim=1)
        out = q * d
        if w.fmt == Q4:
            out = out + _group_untile(w.mins).to(torch.float32).repeat_interleave(GROUP, dim=1)
    return out.to(dtype)


def quantize_int8_groups(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output row in groups of 32 input columns (the Q8 format): each
    group's fp16 scale d = max|w| / 127 (rounded to fp16 first, so q * d is exactly what
    the kernels compute), q = round(w / d) in [-127, 127]. An all-zero group gets d = 1."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    d = (g.abs().amax(dim=-1) / 127.0).to(torch.float16)
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / d.float()[..., None]).clamp_(-127, 127).view(n, k)
    return pack_q8(q, d)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric per-output-row int8: s = max|w| / 127, q = round(w / s) in [-127, 127].
    An all-zero row gets scale 1 (its codes are 0)."""
    w = weight.detach().to(torch.float32)
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return pack_int8(q, scales)
