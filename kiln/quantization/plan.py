"""From which row count each quantized layer runs the kernel's panel path.

`kiln bench kernels --ops linear_quant` times the direct and panel kernels per (format,
layer shape, row count) into the tuning table; a layer's `panel_from` is the row count
from which the panel wins at every larger count measured (0: never). Without entries
for a shape the per-ISA default applies (`default_panel_from`). Either way, prefill-sized
row counts keep exact bf16 activations on the VNNI classes (`layer_panel_from`).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

DIRECT, PANEL = "kiln-quant-direct", "kiln-quant-panel"


def _loaded_isa() -> str:
    from kiln.ops import cpu_kernels

    return cpu_kernels.isa_class() if cpu_kernels.planned() else "none"


def default_panel_from(fmt: int, isa: str | None = None) -> int:
    """Where the tuning table has no entry for a layer. Measured with SmolLM2's shapes
    and 2 threads, bf16 x, every layer's weight distinct (`benchmarks/quant_step.py
    --panel-from 0|1`, the weights streaming from DRAM as in a decode step):
    - AVX512-BF16 (Zen 4): Q4 and Q8_0 run the direct kernel over int8 activations
      (VNNI), which decodes each chunk once per 8 rows and beats the bf16 panel through
      32 rows (1.65x at 8, 1.2x at 32; a whole step's Q4_1 decode with 32 requests 1.29x)
      and ties it at 64-128: never (`layer_panel_from` still keeps prefill-sized rows on
      the panel, for their exact activations). INT8 (fp32 FMAs in the direct kernel): the
      bf16 panel from 8 rows.
    - AMX (a 2-vCPU Sapphire Rapids class Xeon, where the panel runs AMX tiles): Q4 and
      Q8_0 from 32 rows. Streaming, direct vs panel ms per step: Q4 8 rows 5.2 vs 9.7,
      16 rows 8.6 vs 10.9, 32 rows 14.6 vs 14.7, 64 rows 26.2 vs 20.6; Q8_0 7.5 vs 11.0,
      11.2 vs 12.3, 19.0 vs 14.9. INT8 (fp32 FMAs direct) from 8: 11.6 vs 10.7 at 8.
    - AVX2 (Zen 3): Q4's direct kernel over int8 activations beats the fp32 panel at every
      row count (1.4x at 32 rows, 1.06-1.4x at 128): never. INT8 and Q8_0 still run fp32
      FMAs in the direct kernel, and the fp32 panel beats it from 5 (INT8) or 32 (Q8_0)
      rows, 1.2-2.1x at 32-128: 8.
    - plain AVX512 (Zen 4's FMAs): the fp32 panel did not beat the direct kernel at any
      row count: never."""
    from kiln.ops.quant_packing import INT8, Q4

    isa = isa or _loaded_isa()
    if isa == "avx512_bf16":
        return 8 if fmt == INT8 else 0
    if isa == "amx":
        return 8 if fmt == INT8 else 32
    if isa == "avx2" and fmt != Q4:
        return 8
    return 0


# Prefill-sized row counts keep the panel's exact bf16 activations where the direct
# kernel would quantize them to int8 (Q4 and Q8_0 on the VNNI classes): with int8
# activations at every row count Q4_1's perplexity on `kiln bench quality` rose 3.0% over
# bf16 (llama.cpp's: 1.4%), while on Zen 4 the two kernels tied at 64-128 rows with
# streaming weights (the tuning table, timing one weight in cache, prefers the direct
# kernel there by 1.1-1.4x). The table chooses below this row count only. AVX2 keeps its
# measured choice (the int8-activation kernel at every row: 1.06-1.4x over its fp32 panel).
EXACT_PREFILL_ROWS = 64


def layer_panel_from(fmt: int, tuned: int | None, isa: str | None = None) -> int:
    """A layer's panel row count: the table's (`tuned`, None without an entry) or the
    ISA default, capped at EXACT_PREFILL_ROWS where the direct kernel quantizes x."""
    from kiln.ops.quant_packing import Q4, Q8

    isa = isa or _loaded_isa()
    start = default_panel_from(fmt, isa) if tuned is None else tuned
    if isa in ("amx", "avx512_bf16") and fmt in (Q4, Q8) and (
            start == 0 or start > EXACT_PREFILL_ROWS):
        return EXACT_PREFILL_ROWS
    return start


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
    from kiln.ops.tuning import times_by_shape

    times = times_by_shape(entries, dtype, lambda d: (d["fmt"], int(d["n"]), int(d["k"])),
                           "rows")
    return {shape: panel_from_times(t) for shape, t in times.items()}


def load_panel_plans(dtype: torch.dtype) -> dict[tuple[str, int, int], int]:
    from kiln.ops.tuning import device_entries

    return plans_from_table(device_entries("linear_quant", torch.device("cpu")), dtype)
