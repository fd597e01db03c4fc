"""kiln's bf16 SiLU-and-mul, RoPE and add-RMSNorm kernels (csrc/pointwise.cpp) against the
expressions they replace, and the fp32 path, which must stay the reference's own math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from kiln.ops import pointwise

pytestmark = pytest.mark.usefixtures("cpu_kernels_loaded")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    exp = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exp - 7)


# 2,000 rows: the kernel splits them across threads; 1 and 3: one thread; I = 100 and 17
# leave a partial last vector.
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 100), (2000, 1536), (7, 17)])
def test_silu_and_mul_is_the_fp32_result_rounded_once(rows, inter):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    # Far beyond the clamp of the exponent on both sides, and zero.
    x[0, :4] = torch.tensor([-200.0, 200.0, -90.0, 0.0])
    want = F.silu(x[:, :inter].float()) * x[:, inter:].float()
    got = SiluAndMul()(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    # Within one bf16 step of the exact value (the polynomial exp is within 3e-6, so a
    # value may round the other way only next to a rounding boundary).
    assert bool(((got.float() - want).abs() <= bf16_ulp(want)).all())
    assert (got == want.to(torch.bfloat16)).float().mean() > 0.98


def test_silu_and_mul_keeps_leading_dims_and_fp32_math():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert SiluAndMul()(x).shape == (2, 3, 32)
    x32 = torch.randn(5, 64)
    gate, up = x32.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(x32), F.silu(gate) * up)  # fp32: not the kernel


def reference_rope(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor
                   ) -> torch.Tensor:
    """The reference's formula, in fp32 from the bf16 inputs and bf16 cos / sin."""
    cos = rope.cos[positions].unsqueeze(1).to(x.dtype).float()
    sin = rope.sin[positions].unsqueeze(1).to(x.dtype).float()
    return x.float() * cos + pointwise._rotate_half(x).float() * sin


@pytest.mark.parametrize("tokens", [1, 5, 2000])
def test_rope_matches_the_reference_on_views_of_qkv(tokens):
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    qkv = torch.randn(tokens, 960).to(torch.bfloat16)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    q, k = q.reshape(tokens, 9, 64), k.reshape(tokens, 3, 64)  # strided views, as in a model
    positions = torch.randint(0, 4096, (tokens,))
    got_q, got_k = rope(positions, q, k)
    assert got_q.is_contiguous() and got_k.shape == k.shape
    # One rounding of the same products: equal to the reference rounded once.
    assert torch.equal(got_q, reference_rope(rope, positions, q).to(torch.bfloat16))
    assert torch.equal(got_k, reference_rope(rope, positions, k).to(torch.bfloat16))


def test_rope_refuses_a_position_outside_its_cache_and_keeps_fp32_math():
    rope = RotaryEmbedding(64, 16, 10000.0, None)
    q, k = torch.randn(2, 2, 64, dtype=torch.bfloat16), torch.randn(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="position 16 outside the cache of 16"):
        rope(torch.tensor([3, 16]), q, k)
    q32, k32, pos = q.float(), k.float(), torch.tensor([3, 7])
    got_q, _ = rope(pos, q32, k32)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    assert torch.equal(got_q, q32 * cos + pointwise._rotate_half(q32) * sin)


def bf16_norm(hidden: int, seed: int) -> RMSNorm:
    torch.manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16).requires_grad_(False)
    norm.weight.data = torch.randn(hidden).to(torch.bfloat16)
    return norm


# 2,000 rows: split across threads; 1 and 3: one thread; 4,096 wide: a large model's rows.
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (2000, 576), (40, 4096)])
def test_add_rms_norm_rounds_where_the_reference_does(rows, hidden):
    norm = bf16_norm(hidden, rows)
    x = (torch.randn(rows, hidden) * 3).to(torch.bfloat16)
    d = torch.randn(rows, hidden).to(torch.bfloat16)
    h, out = norm.forward_add(x, d)
    assert torch.equal(h, x + d)  # the bf16 add, bit for bit
    want = norm(x + d)  # the reference's expression (float32 norm, bf16 scale)
    # The sum of squares is added in another order: the normalised value may round the
    # other way next to a rounding boundary, one bf16 step, which the weight's product
    # carries into at most two steps of the output.
    assert bool(((out.float() - want.float()).abs() <= 2 * bf16_ulp(want.float())).all())
    assert (out == want).float().mean() > 0.999


def test_add_rms_norm_is_the_same_on_one_thread_and_keeps_fp32_math():
    norm = bf16_norm(576, 7)
    x, d = (torch.randn(2000, 576).to(torch.bfloat16) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = norm.forward_add(x, d)
        torch.set_num_threads(2)
        two = norm.forward_add(x, d)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    norm32 = RMSNorm(576, 1e-5).requires_grad_(False)
    x32, d32 = x.float(), d.float()
    h32, out32 = norm32.forward_add(x32, d32)  # fp32: not the kernel, the same expressions
    assert torch.equal(h32, x32 + d32) and torch.equal(out32, norm32(x32 + d32))
