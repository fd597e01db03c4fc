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


def default_panel_from() -> int:
    """Measured on Zen 4 (SmolLM2's shapes, 2 threads): with AVX512-BF16 the bf16 panel
    beats the direct kernel from 8 rows (1.3-2x at 32-128 rows); the fp32 panel (what
    the FMA-only classes run) did not beat it at any row count there, so it stays off
    by default. The AVX2 class has not been timed on a quiet host: run
    `kiln bench kernels --ops linear_quant` there and the table decides."""
    from kiln.ops import cpu_kernels

    native = cpu_kernels.loaded() and cpu_kernels.isa_class() in ("amx", "avx512_bf16")
    return 8 if native else 0


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
