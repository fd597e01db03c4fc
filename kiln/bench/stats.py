"""Summaries of measured distributions: the percentiles every bench mode reports.

Averages hide jitter (one slow decode step in a hundred is invisible in the mean), so
every distribution is reported as p50/p90/p99 next to its mean, min and max.
"""
from __future__ import annotations

import math
from typing import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int]:
    """{"n", "mean", "min", "p50", "p90", "p99", "max"} in the unit of `values`.

    An empty distribution summarises to n=0 and NaNs (written as null in JSON)."""
    if not values:
        return {"n": 0, "mean": math.nan, "min": math.nan,
                **{f"p{q}": math.nan for q in PERCENTILES}, "max": math.nan}
    return {"n": len(values), "mean": sum(values) / len(values), "min": min(values),
            **{f"p{q}": percentile(values, q) for q in PERCENTILES}, "max": max(values)}


def scaled(values: Sequence[float], factor: float) -> list[float]:
    """Unit conversion (seconds -> milliseconds is factor 1000)."""
    return [v * factor for v in values]
