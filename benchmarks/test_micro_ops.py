"""pytest-benchmark micro-benchmarks of the hot ops, one per (op, shape, candidate).

The cases are the ones `kiln bench kernels` tunes (kiln/bench/cases.py,
kernel_attention.py), so the two agree on what is measured; this file adds
pytest-benchmark's statistics, grouping and saved-run comparison (`--benchmark-save`,
`--benchmark-compare`).
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from micro_common import micro_shapes
from kiln.bench.kernels import OPS


@lru_cache(maxsize=1)
def _cases():
    with torch.inference_mode():
        return [(op, case) for op in OPS for case in OPS[op](micro_shapes(), True)]


def _params():
    return [pytest.param(i, j, id=f"{op}-{case.key}-{cand.label}")
            for i, (op, case) in enumerate(_cases())
            for j, cand in enumerate(case.candidates)]


@pytest.mark.parametrize("case_index,cand_index", _params())
def test_op(benchmark, case_index: int, cand_index: int) -> None:
    op, case = _cases()[case_index]
    cand = case.candidates[cand_index]
    benchmark.group = f"{op} {case.key}"
    reference = case.candidates[0].run()
    out = cand.run()  # also compiles torch.compile candidates before timing
    assert case.compare(reference, out) is None
    benchmark(cand.run)
