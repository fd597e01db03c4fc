"""From which row count each quantized layer runs the kernel's panel path.

`kiln bench kernels --ops linear_quant` times the direct and panel kernels per (format,
layer shape, row count) into the tuning table; a layer's `panel_from` is the row count
from which the panel wins at every larger count measured (0: never). Without entries
for a shape the per-ISA default applies (`default_panel_from`).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

DIRECT, PANEL = "kiln-quant-direct", "kiln-quant-panel"


def default_panel_from(fmt: int) -> int:
    """Where the tuning table has no entry for a layer. Measured with SmolLM2's shapes
    and 2 threads, bf16 x, every layer's weight distinct (`benchmarks/quant_step.py
    --panel-from 0|1`, the weights streaming from DRAM as in a decode step):
    - AVX512-BF16 (Zen 4): Q4 and Q8_0 run the direct kernel over int8 activations
      (VNNI), which decodes each chunk once per 8 rows and beats the bf16 panel through
      32 rows (1.65x at 8, 1.2x at 32; a whole step's Q4_1 decode with 32 requests 1.29x)
      and ties it at 64-128: 64, so decode batches take the faster kernel and prefill
      keeps exact bf16 activations (with int8 ones there Q4_1's perplexity rose 3%,
      llama.cpp's is 1.4% over bf16). INT8 (fp32 FMAs in the direct kernel): the bf16
      panel from 8 rows.
    - AMX: 8 for every format (the same two kernels, not measured on an AMX host).
    - AVX2 (Zen 3): Q4's direct kernel over int8 activations beats the fp32 panel at every
      row count (1.4x at 32 rows, 1.06-1.4x at 128): never. INT8 and Q8_0 still run fp32
      FMAs in the direct kernel, and the fp32 panel beats it from 5 (INT8) or 32 (Q8_0)
      rows, 1.2-2.1x at 32-128: 8.
    - plain AVX512 (Zen 4's FMAs): the fp32 panel did not beat the direct kernel at any
      row count: never."""
    from kiln.ops import cpu_kernels
    from kiln.quantization.packing import INT8, Q4

    isa = cpu_kernels.isa_class() if cpu_kernels.loaded() else "none"
    if isa == "avx512_bf16":
        return 8 if fmt == INT8 else 64
    if isa == "amx" or (isa == "avx2" and fmt != Q4):
        return 8
    return 0


def panel_from_times(times: Mapping[int, Mapping[str, float]]) -> int:
    """{rows: {candidate: us}} for one (format, shape) -> panel_from."""
    start = 0
    for rows in sorted(times, reverse=True):  # the run of panel wins at the top
        t = times[rows]
        if PANEL not in t or DIRECT not in t or t[PANEL] >= t[DIRECT]:
            break
        start = rows
    return start


def plans_from_table(entries: Mapping[str, Any], dtype: torch.dtype
                     ) -> dict[tuple[str, int, int], int]:
    """{(format, n, k): panel_from} from a device's "linear_quant" entries for `dtype`."""
    from kiln.bench.tuning import times_by_shape

    times = times_by_shape(entries, dtype, lambda d: (d["fmt"], int(d["n"]), int(d["k"])),
                           "rows")
    return {shape: panel_from_times(t) for shape, t in times.items()}


def load_panel_plans(dtype: torch.dtype) -> dict[tuple[str, int, int], int]:
    from kiln.bench.tuning import device_entries

    return plans_from_table(device_entries("linear_quant", torch.device("cpu")), dtype)
