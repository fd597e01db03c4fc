"""`kiln bench kernels --ops linear_quant`: the quantized linear's two kernels per format,
layer shape and row count.

  kiln-quant-direct  register tiles over the codes (the reference: first candidate)
  kiln-quant-panel   each column block dequantized once per block of rows, then a tile
                     over it (`vdpbf16ps` on bf16 codes with AVX512-BF16, fp32 elsewhere)

The engine reads the winners back per (format, shape) as the row count from which the
panel runs (kiln/quantization/plan.py): the `panel_from` argument of the op.
"""
from __future__ import annotations

import torch

from kiln.bench.cases import Candidate, Case, Shapes, close
from kiln.bench.cases_linear import layer_shapes
from kiln.ops import cpu_kernels
from kiln.ops.linear import linear_quant
from kiln.ops.quant_packing import (FORMAT_NAMES, INT8, Q4, Q8, QuantWeight, pack_q4, pack_q8,
                                    quantize_int8)
from kiln.ops.tuning import shape_key


def quant_key(rows: int, n: int, k: int, fmt: int, dtype: torch.dtype) -> str:
    return shape_key(rows=rows, n=n, k=k, fmt=FORMAT_NAMES[fmt], dtype=dtype)


def random_weight(fmt: int, n: int, k: int, g: torch.Generator) -> QuantWeight:
    if fmt == INT8:
        return quantize_int8(torch.randn(n, k, generator=g) * k ** -0.5)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    if fmt == Q8:
        return pack_q8(torch.randint(-127, 128, (n, k), generator=g), d)
    return pack_q4(torch.randint(0, 16, (n, k), generator=g), d, -8 * d)


def linear_quant_cases(s: Shapes, compiled: bool) -> list[Case]:
    del compiled  # nothing to compile: both candidates are kiln's kernel
    if s.device.type != "cpu" or not cpu_kernels.loaded():
        return []
    g = torch.Generator().manual_seed(0)
    cases = []
    for fmt in (INT8, Q8, Q4):
        for n, k in layer_shapes(s).values():
            if n % 16 or k % 32:
                continue
            w = random_weight(fmt, n, k, g)
            for rows in s.token_counts:
                x = torch.randn(rows, k, generator=g).to(s.dtype)
                cands = [Candidate(name, lambda x=x, w=w, p=p: linear_quant(
                    x, w.codes, w.scales, w.mins, None, w.fmt, p))
                    for name, p in (("kiln-quant-direct", 0), ("kiln-quant-panel", 1))]
                tol = 1e-4 if s.dtype == torch.float32 else 2e-2
                cases.append(Case("linear_quant", quant_key(rows, n, k, fmt, s.dtype), cands,
                                  compare=lambda a, b, tol=tol: close(a, b, tol)))
    return cases
