"""A decoder layer's bf16 pointwise steps on kiln's CPU kernels (csrc/pointwise.cpp: one
rounding, threads only at prefill sizes), the plain expressions elsewhere: fp32 keeps the
reference's exact math, which Inductor fuses.

  silu_and_mul   SwiGLU's activation, silu(gate) * up over [..., 2I] (gate | up);
  add_rms_norm   a residual add and the RMSNorm after it (where add_rms_norm_applies;
                 kiln.models.layers.RMSNorm.forward_add owns the expressions elsewhere);
  rotary_neox    Neox-style RoPE of q [T, H, D] and k [T, Hk, D] from float32 cos / sin
                 caches [P, D] (cast to the activations' dtype, as the reference does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import cpu_kernels


ROPE_MAX_HEAD_DIM = 512  # csrc/pointwise.cpp's kMaxHeadDim: its cos / sin rows on the stack


def kernel_applies(x: torch.Tensor) -> bool:
    return cpu_kernels.planned() and x.device.type == "cpu" and x.dtype == torch.bfloat16


def add_rms_norm_applies(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes x + d and the RMSNorm after it (else the caller,
    kiln.models.layers.RMSNorm.forward_add, runs its own expressions)."""
    return (kernel_applies(x) and x.shape[-1] % 16 == 0 and d.shape == x.shape
            and d.dtype == x.dtype and weight.dtype == x.dtype)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + d, weight * norm(x + d)) over [..., H] in one kernel, rounded where
    RMSNorm's bf16 tensors round (csrc/pointwise.cpp)."""
    h, out = torch.ops.kiln_cpu.add_rms_norm(x.reshape(-1, x.shape[-1]),
                                             d.reshape(-1, x.shape[-1]), weight, eps)
    return h.view(x.shape), out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if kernel_applies(x):
        lead = x.shape[:-1]
        out = torch.ops.kiln_cpu.silu_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*lead, out.shape[-1])
    return silu_and_mul_native(x)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_kernel_applies(x: torch.Tensor, cos_cache: torch.Tensor) -> bool:
    """Whether kiln's RoPE kernel rotates bf16 heads of cos_cache.shape[1] from x's dtype
    (rotary_embedding, or in the QKV GEMM's epilogue: kiln.ops.linear.linear_rope)."""
    head_dim = cos_cache.shape[-1]
    return (kernel_applies(x) and head_dim % 32 == 0 and head_dim <= ROPE_MAX_HEAD_DIM
            and cos_cache.dtype == torch.float32)


def rotary_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_cache: torch.Tensor, sin_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    if rope_kernel_applies(q, cos_cache) and k.dtype == q.dtype:
        return torch.ops.kiln_cpu.rotary_embedding(positions, q, k, cos_cache, sin_cache)
    return rotary_neox_native(positions, q, k, cos_cache, sin_cache)


def rotary_neox_native(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       cos_cache: torch.Tensor, sin_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
