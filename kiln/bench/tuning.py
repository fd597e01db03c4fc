"""The kernel tuning table: written by `kiln bench kernels`, read at engine start-up.

One JSON file holds the winners for several devices:

    {"version": 1,
     "devices": {"<device name>": {"<op>": {"<shape key>": {
         "best": "<candidate>", "config": {...} | null, "us": {"<candidate>": median_us}}}}}}

A shape key is `k=v` pairs joined by commas in a fixed order (see `shape_key`). The file is
`$KILN_TUNING_FILE`, else `$KILN_HOME/tuning.json`. The runtime only reads it; a missing,
unreadable or malformed file means "no tuning" (a warning, never a failed start-up).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from kiln.bench.report import device_name

logger = logging.getLogger(__name__)

VERSION = 1


def default_tuning_path() -> Path:
    env = os.environ.get("KILN_TUNING_FILE")
    if env:
        return Path(env).expanduser()
    from kiln.models.model_source import kiln_home  # late: kiln.models imports attention

    return kiln_home() / "tuning.json"


def shape_key(**dims: Any) -> str:
    """'phase=decode,batch=8,...' in the caller's order; dtypes written without 'torch.'."""
    return ",".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in dims.items())


def parse_key(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(",") if "=" in part)


def load_tuning(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The whole table ({} when there is none or it cannot be used)."""
    p = Path(path) if path is not None else default_tuning_path()
    if not p.is_file():
        return {}
    try:
        table = json.loads(p.read_text())
        if table.get("version") != VERSION or not isinstance(table.get("devices"), dict):
            raise ValueError(f"expected version {VERSION} with a 'devices' object")
        return table
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("ignoring the tuning table %s (%s); rerun `kiln bench kernels`", p, exc)
        return {}


def device_entries(op: str, device: str | torch.device = "cpu") -> dict[str, Any]:
    """This device's tuning entries for `op` ({shape key: entry}; {} without any)."""
    ops = load_tuning().get("devices", {}).get(device_name(device), {})
    entries = ops.get(op, {})
    return entries if isinstance(entries, dict) else {}


def times_by_shape(entries: Mapping[str, Any], dtype: torch.dtype,
                   shape_of: Callable[[dict[str, str]], tuple], count: str
                   ) -> dict[tuple, dict[int, dict[str, float]]]:
    """{shape_of(dims): {int(dims[count]): {candidate: median us}}} over one op's entries
    for `dtype`, for the plans the engine derives at start-up. Keys missing a dimension
    are skipped; candidate labels lose their "[config]" suffix."""
    name = str(dtype).removeprefix("torch.")
    times: dict[tuple, dict[int, dict[str, float]]] = {}
    for key, entry in entries.items():
        dims = parse_key(key)
        if dims.get("dtype") != name or not isinstance(entry, dict):
            continue
        try:
            shape, n = shape_of(dims), int(dims[count])
        except (KeyError, ValueError):
            continue
        times.setdefault(shape, {})[n] = {
            label.split("[", 1)[0]: us for label, us in entry.get("us", {}).items()}
    return times


def lookup(op: str, shape: str, device: str | torch.device = "cpu",
           path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The entry for one op and shape key on this device: {"best", "config", "us"}."""
    ops = load_tuning(path).get("devices", {}).get(device_name(device), {})
    entry = ops.get(op, {}).get(shape)
    return entry if isinstance(entry, dict) else None


def preferred_attention_backend(head_size: int, dtype: torch.dtype, device: torch.device,
                                backends: Mapping[str, Any],
                                path: str | os.PathLike | None = None) -> str | None:
    """The backend among `backends` (name -> class) that won the most tuned attention
    shapes with this head size and dtype on this device and whose `supports()` accepts this
    configuration (ties: the first name in alphabetical order); None without tuning data.

    Backends are chosen once per engine, not per step, so the per-shape winners are
    reduced to one vote here."""
    entries = load_tuning(path).get("devices", {}).get(device_name(device), {})
    if not entries.get("attention"):
        return None
    allowed = {n for n, c in backends.items() if c.supports(head_size, dtype, device) is None}
    want = {"head_size": str(head_size), "dtype": str(dtype).removeprefix("torch.")}
    wins: dict[str, int] = {}
    for key, entry in entries.get("attention", {}).items():
        dims = parse_key(key)
        best = entry.get("best") if isinstance(entry, dict) else None
        if best in allowed and all(dims.get(k) == v for k, v in want.items()):
            wins[best] = wins.get(best, 0) + 1
    if not wins:
        return None
    choice = min(wins, key=lambda n: (-wins[n], n))
    logger.info("attention backend %r from the tuning table (fastest on %d of %d tuned "
                "shapes)", choice, wins[choice], sum(wins.values()))
    return choice


def merge_into(path: str | os.PathLike, device: str,
               results: dict[str, dict[str, dict[str, Any]]]) -> Path:
    """Write `results` ({op: {shape key: entry}}) for `device` into the table at `path`,
    keeping other devices' entries and other shapes; written atomically (temp + rename)."""
    p = Path(path)
    table = load_tuning(p) or {"version": VERSION, "devices": {}}
    ops = table["devices"].setdefault(device, {})
    for op, shapes in results.items():
        ops.setdefault(op, {}).update(shapes)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p
