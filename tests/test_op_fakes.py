"""Every kiln op that returns a tensor: its fake implementation (what Dynamo and Inductor
plan buffers from) describes the real output exactly: shape, strides and dtype.

kiln compiles with Inductor's size and alignment asserts off (kiln/compiler/adaptors.py:
they cost 5-10% of a batch-1 decode step), so a fake that drifted from its kernel would
no longer fail at run time; it fails here, for odd row counts and every weight format."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.moe.op import fused_moe
from kiln.ops.linear import pack
from kiln.ops.quant_packing import pack_q4, pack_q8, quantize_int8

ROWS = (1, 5, 33)  # decode, a verify step (1 + 4 drafts), a batch with a partial tile


def assert_fake_matches(op: Callable[..., Any], *args: Any) -> None:
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args)
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("m", ROWS)
def test_cpu_linear_fakes(m):
    g = torch.Generator().manual_seed(m)
    n, k = 48, 96
    weights = [quantize_int8(torch.randn(n, k, generator=g)),
               pack_q8(torch.randint(-127, 128, (n, k), generator=g),
                       torch.rand(n, k // 32, generator=g)),
               pack_q4(torch.randint(0, 16, (n, k), generator=g),
                       torch.rand(n, k // 32, generator=g), torch.rand(n, k // 32, generator=g))]
    bias = torch.randn(n, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, k, generator=g).to(dtype)
        for w in weights:
            for panel_from in (0, 1):
                assert_fake_matches(torch.ops.kiln_cpu.linear_quant.default, x, w.codes,
                                    w.scales, w.mins, bias, w.fmt, panel_from)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    assert_fake_matches(torch.ops.kiln_cpu.linear_packed.default, x, pack(w),
                        bias.to(torch.bfloat16))
    cos = torch.randn(64, 32, generator=g)  # heads of 32: 48 = one roped head, then V
    assert_fake_matches(torch.ops.kiln_cpu.linear_packed_rope.default, x, pack(w),
                        bias.to(torch.bfloat16), torch.arange(m), cos, cos, 32)
    logits = torch.randn(m, 1000, generator=g).to(torch.bfloat16)
    assert_fake_matches(torch.ops.kiln_cpu.greedy_argmax.default, logits)
    h, d = (torch.randn(m, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    for i in range(2):  # each of the (h, norm) pair
        assert_fake_matches(lambda *a: torch.ops.kiln_cpu.add_rms_norm.default(*a)[i],
                            h, d, torch.randn(64, generator=g).to(torch.bfloat16), 1e-5)


@pytest.mark.parametrize("m", ROWS)
def test_fused_moe_fake(m):
    g = torch.Generator().manual_seed(m)
    hidden, inter, experts = 32, 48, 4
    x = torch.randn(m, hidden, generator=g)
    assert_fake_matches(fused_moe, x, torch.randn(m, experts, generator=g),
                        torch.randn(experts, 2 * inter, hidden, generator=g),
                        torch.randn(experts, hidden, inter, generator=g), 2, True)
