"""The kernel tuning table's writer (`kiln bench kernels`); the runtime reads the table
through kiln.ops.tuning, where its format is described."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.ops.tuning import VERSION, load_tuning


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
