"""The quantized linear on CUDA: the Triton dequant-GEMM against the dequantized
reference for every format, and an fp8 / int8 model against its dequantized twin."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.ops.quant_packing import dequantize, quantize_fp8, quantize_int8_groups
from kiln.ops.triton_quant import linear_quant_cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("quantize", [quantize_int8_groups, quantize_fp8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (7, 48, 96), (64, 3072, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_matches_reference(quantize, m, n, k, dtype):
    g = torch.Generator().manual_seed(m + n + k)
    w = quantize(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = F.linear(x.float(), dequantize(w))
    dev = [t.cuda() if t is not None else None for t in (w.codes, w.scales, w.mins)]
    out = linear_quant_cuda(x.cuda(), *dev, None, w.fmt).float().cpu()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert ((out - ref).abs().max() / ref.abs().max()).item() < tol
