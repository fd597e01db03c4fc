"""What every bench mode shares on output: a plain-text table, the JSON file, and the
facts about where the numbers were measured."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from kiln.platforms import device_name
from kiln.version import __version__

SCHEMA_VERSION = 1


def environment(device: str = "cpu") -> dict[str, Any]:
    """Where and when: enough to tell two JSON files from different machines apart."""
    return {"kiln_version": __version__, "torch_version": torch.__version__,
            "device": device_name(device), "num_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def engine_facts(engine: Any) -> dict[str, Any]:
    """The engine settings that change the numbers, for a result's `config`."""
    return {"model": str(engine.model_config.path),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "optimization_level": engine.config.optimization_level,
            "attention_backend": engine.executor.attention_backend,
            "tensor_parallel_size": engine.executor.tp_size}


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=2, allow_nan=False) + "\n")
    return out


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """Numbers right-aligned, text (and the first column, which names the row) left."""
    cells = [[fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    text = [i == 0 or all(isinstance(r[i], str) for r in rows) for i in range(len(headers))]

    def line(items: Sequence[str]) -> str:
        return "  ".join(item.ljust(w) if left else item.rjust(w)
                         for item, w, left in zip(items, widths, text)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def summary_rows(named: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Rows of `table(SUMMARY_HEADERS, ...)` from {label: summarize(...)}."""
    return [[label, s["n"], s["mean"], s["p50"], s["p90"], s["p99"], s["max"]]
            for label, s in named.items()]


SUMMARY_HEADERS = ("metric", "n", "mean", "p50", "p90", "p99", "max")


def repeats_table(runs: dict[str, list[float]], median: dict[str, float],
                  overhead: dict[str, float], baseline: str, value: str,
                  digits: int) -> str:
    """Interleaved runs side by side: per run its median `value`, each repeat, and its
    overhead over the `baseline` run."""
    repeats = max(len(v) for v in runs.values())
    rows = [[name, median[name], *runs[name],
             "" if name == baseline else f"{100 * overhead[name]:+.1f}%"] for name in runs]
    headers = ["run", f"median {value}", *[f"#{i + 1}" for i in range(repeats)],
               f"overhead vs {baseline}"]
    return table(headers, rows, digits=digits)
