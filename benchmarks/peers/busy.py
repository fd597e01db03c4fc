"""How busy the CPUs are right now, from /proc/stat (Linux; None elsewhere).

Sampled just before each measured process starts, while nothing of ours runs. It matters
more than usual here: with torch's default of one OpenMP thread per core, a 2-core machine
that another process keeps busy does not make an engine 2x slower but 20-40x slower
(threads spin at barriers waiting for a descheduled peer; measured: kiln batch-1 decode
0.5 tok/s with 2 threads vs 11.8 with 1 while other tests ran). Such rows are flagged.
"""
from __future__ import annotations

import time

BUSY_WARN = 0.15  # fraction of all CPUs used by others that makes a row suspect


def _jiffies() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle


def cpu_busy(interval_s: float = 1.0) -> float | None:
    """Fraction (0..1) of all CPUs' time spent busy during the next `interval_s`."""
    a = _jiffies()
    time.sleep(interval_s)
    b = _jiffies()
    if a is None or b is None or b[0] == a[0]:
        return None
    return 1.0 - (b[1] - a[1]) / (b[0] - a[0])
