"""The LoRA Triton kernels against the PyTorch op, on the CPU under TRITON_INTERPRET=1.

The interpreter runs each program in numpy: correct but slow, so shapes stay small.
tests/conftest.py sets TRITON_INTERPRET=1 on hosts without CUDA (before Triton's first
import); with CUDA these skip and tests/gpu/test_lora_triton.py runs the compiled kernels.
"""
from __future__ import annotations

import pytest
import torch

from kiln.ops.lora import lora_apply

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret() -> None:
    from kiln.ops.triton_runtime import interpreter_reason

    reason = interpreter_reason()
    if reason is not None:
        pytest.skip(reason)


def make_case(T: int, S: int, NR: int, d_in: int, d_out: int, dtype: torch.dtype,
              slots: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """(y, x, lora_a, lora_b, scaling, indices) with O(1) updates; `slots` repeats over the
    T tokens and indices carry spare entries past T that hold an invalid slot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g)
    y = torch.randn(T, d_out, generator=g)
    a = torch.randn(S * NR, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(S * NR, d_out, generator=g) / NR ** 0.5  # B^T
    scaling = torch.rand(S, generator=g) + 0.5
    indices = torch.tensor([slots[t % len(slots)] for t in range(T)] + [S + 7] * 3)
    return (y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), scaling, indices)


def check(args: tuple[torch.Tensor, ...]) -> None:
    """The kernels equal the PyTorch op in its dtype; in bfloat16 they are also within one
    rounding of the op in float32 (the kernels accumulate in fp32 and round once). One ulp
    (2^-7), not half: Triton 3.9's interpreter truncates fp32 -> bf16 where compiled code
    rounds to nearest (tests/gpu/test_lora_triton.py holds it to half an ulp)."""
    from kiln.ops.triton_lora import lora_apply_triton

    compare(lora_apply_triton(*args), args, half_rtol=2 ** -7, fp32_tol=1e-5)


def compare(out: torch.Tensor, args: tuple[torch.Tensor, ...], half_rtol: float,
            fp32_tol: float) -> None:
    """`out` (on the CPU) against the PyTorch op on `args`: in their dtype, against the
    op in fp32 for half types (within `half_rtol`), and rows without an adapter exact."""
    y, x, a, b, scaling, indices = args
    assert out.shape == y.shape and out.dtype == y.dtype
    ref = lora_apply(*args)
    if y.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=fp32_tol, atol=fp32_tol)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=3e-2)
        ref32 = lora_apply(*(t.float() for t in args[:4]), scaling, indices)
        torch.testing.assert_close(out.float(), ref32, rtol=half_rtol, atol=1e-4)
    base = indices[:x.shape[0]] < 0
    assert torch.equal(out[base], y[base])  # no adapter: y bit for bit


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,d_in,d_out", [(1, 40, 70), (37, 24, 70)])
def test_mixed_slots_with_base_rows(dtype, T, d_in, d_out):
    """S=3 slots of 3 shards x rank 5 (NR=15, not a power of two); out=70 spans two blocks,
    the second partial; T=1 takes slot 1, T=37 mixes every slot with -1 rows."""
    check(make_case(T, 3, 15, d_in, d_out, dtype, [1, -1, 0, 2, 2, -1, 0], seed=T))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_one_slot_and_no_adapter_at_all(dtype):
    """The op's two short cuts (every token one slot; every token -1), and an input
    dimension over two K blocks with a partial last one."""
    for slots in ([2], [-1]):
        check(make_case(5, 3, 15, 200, 24, dtype, slots, seed=3))


def test_no_tokens_and_strided_inputs():
    """T=0 launches nothing; y and x may be column slices of wider buffers (row stride !=
    width)."""
    from kiln.ops.triton_lora import lora_apply_triton

    y, x, a, b, scaling, indices = make_case(0, 2, 6, 16, 20, torch.float32, [0], seed=4)
    assert lora_apply_triton(y, x, a, b, scaling, indices).shape == (0, 20)
    y, x, a, b, scaling, indices = make_case(6, 2, 6, 16, 20, torch.float32, [1, -1, 0], 5)
    wide_y, wide_x = torch.zeros(6, 33), torch.zeros(6, 29)
    wide_y[:, 3:23], wide_x[:, 5:21] = y, x
    out = lora_apply_triton(wide_y[:, 3:23], wide_x[:, 5:21], a, b, scaling, indices)
    torch.testing.assert_close(out, lora_apply(y, x, a, b, scaling, indices))


def test_slot_contents_and_indices_are_read_per_call():
    """Nothing about the slots is cached between launches: rewriting a slot in place and
    moving tokens to other slots changes the result as the reference says."""
    args = make_case(4, 2, 3, 8, 10, torch.float32, [0, 0, 1, -1], seed=6)
    check(args)
    y, x, a, b, scaling, indices = args
    a[3:6].mul_(-2.0)
    b[:, 3:6].add_(1.0)
    scaling[1] = 3.0
    indices[:4] = torch.tensor([1, -1, 1, 0])
    check(args)
