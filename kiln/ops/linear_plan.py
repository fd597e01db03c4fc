"""Which kernel each linear layer runs, at which row counts: the tuning table decides.

`kiln bench kernels --ops linear` times every candidate per layer shape and row count
(kiln/bench/cases_linear.py) and writes them to the tuning table. At start-up each bf16
linear gets a `LinearPlan` from those times: the engine can run kiln's packed kernel and
PyTorch's GEMM on the plain weight, so a plan says whether the layer is packed and from
which row count on (if any) the plain weight takes over. Keeping both layouts costs the
plain weight's memory, so a plan keeps it only where the table shows a row count at which
F.linear wins and keeps winning above it.

Without table entries for a shape, every ISA class packs at every row count. Measured
(`kiln bench kernels --ops linear`): on AVX512 without bf16 (Ice Lake class, FMA path)
the packed kernel beats oneDNN's bf16 GEMM 3x at every row count from 1 to 512; on AVX2
(Zen 3 class) it beats oneDNN's emulated bf16 GEMM 1.4-7.4x at every row count, so
F.linear never wins there; on AMX it beat oneDNN at every row count when it was written.
AVX512-BF16 without AMX (Zen 4) has not been timed by us: run the harness there and the
table overrides the default.

On AMX hosts the packed kernel itself has two paths: tiles, and the AVX512-BF16 register
kernel. Tiles compute 16 rows whatever a batch holds, so at one row the register kernel
is faster. Measured on a 2-vCPU Sapphire Rapids class Xeon (SmolLM2's five shapes,
2026-12-06): at 1 row the register kernel took 0.81-0.92x the tiles' time, at 2 rows
0.85-1.64x (the lm_head still favoured registers), from 3 rows on the tiles won every
shape (1.3-9x). The row count from which tiles run is one process-wide setting
(`amx_from`): the harness times both paths (`kiln-packed-regs` is the register one) and
the smallest row count from which the tiles' total over the model's shapes is no slower,
there and at every larger count measured, is taken. Without entries: AMX_FROM_DEFAULT.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

PACKED, DENSE = "kiln-packed", "F.linear"
REGS = "kiln-packed-regs"  # the packed kernel with AMX tiles off (timed on AMX hosts only)
AMX_FROM_DEFAULT = 2


@dataclass(frozen=True, slots=True)
class LinearPlan:
    pack: bool = True
    dense_from: int = 0  # rows from which F.linear on the plain weight runs; 0: never

    def describe(self) -> str:
        if not self.pack:
            return "F.linear"
        return "packed" if self.dense_from == 0 else f"packed < {self.dense_from} rows <= F.linear"


DEFAULT = LinearPlan()


def plan_from_times(times: Mapping[int, Mapping[str, float]]) -> LinearPlan:
    """A plan from {rows: {candidate: median us}} for one shape (only the candidates the
    engine can run count)."""
    winners = []
    for rows in sorted(times):
        runnable = {c: t for c, t in times[rows].items() if c in (PACKED, DENSE)}
        if runnable:
            winners.append((rows, min(runnable, key=runnable.__getitem__)))
    if not winners:
        return DEFAULT
    if all(w == DENSE for _, w in winners):
        return LinearPlan(pack=False)
    dense_from = 0
    for rows, w in reversed(winners):  # the longest run of F.linear wins at the top
        if w != DENSE:
            break
        dense_from = rows
    return LinearPlan(pack=True, dense_from=dense_from)


def plans_from_table(entries: Mapping[str, Any], dtype: torch.dtype
                     ) -> dict[tuple[int, int], LinearPlan]:
    """{(n, k): plan} from a device's "linear" tuning entries for `dtype`."""
    from kiln.ops.tuning import times_by_shape

    times = times_by_shape(entries, dtype, lambda d: (int(d["n"]), int(d["k"])), "rows")
    return {shape: plan_from_times(t) for shape, t in times.items()}


def load_plans(dtype: torch.dtype, device: torch.device) -> dict[tuple[int, int], LinearPlan]:
    """The tuning table's plans for this host (empty: the defaults apply)."""
    from kiln.ops.tuning import device_entries

    return plans_from_table(device_entries("linear", device), dtype)


def amx_from_times(times: Mapping[tuple, Mapping[int, Mapping[str, float]]]) -> int:
    """The row count from which the packed kernel uses AMX tiles, from {shape: {rows:
    {candidate: us}}}: the smallest one where the tiles' total over the shapes timed with
    both paths is no slower than the registers', there and at every larger row count."""
    totals: dict[int, list[float]] = {}
    for by_rows in times.values():
        for rows, cands in by_rows.items():
            if PACKED in cands and REGS in cands:
                t = totals.setdefault(rows, [0.0, 0.0])
                t[0] += cands[PACKED]
                t[1] += cands[REGS]
    if not totals:
        return AMX_FROM_DEFAULT
    amx_from = max(totals) + 1  # registers win at the top: tiles never
    for rows in sorted(totals, reverse=True):
        tiles, regs = totals[rows]
        if tiles > regs:
            break
        amx_from = rows
    return amx_from


def load_amx_from(device: torch.device | str = "cpu") -> int:
    """This host's `amx_from` from the tuning table's bf16 linear entries."""
    from kiln.ops.tuning import device_entries, times_by_shape

    return amx_from_times(times_by_shape(device_entries("linear", device), torch.bfloat16,
                                         lambda d: (int(d["n"]), int(d["k"])), "rows"))
