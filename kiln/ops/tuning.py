"""The kernel tuning table: read at engine start-up (the writer is `kiln bench kernels`,
kiln.bench.tuning.merge_into).

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

from kiln import envs
from kiln.platforms import device_name

logger = logging.getLogger(__name__)

VERSION = 1


def default_tuning_path() -> Path:
    return envs.KILN_TUNING_FILE or envs.kiln_home() / "tuning.json"


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


# The chunked-prefill token budget measured per host by `kiln bench budget`: one entry per
# model, requested dtype and quantization ("best" is the budget, "us" each candidate's
# prefill time of the measured prompt).
BUDGET_OP = "prefill_budget"


def budget_key(model: str | None, dtype: str, quantization: str | None) -> str:
    """The table key of an engine's budget, from its requested settings: the model's
    directory or file name (the embedded default: "default"), dtype as given ("auto"
    included) and quantization (unset: "checkpoint")."""
    name = Path(model).name if model else "default"
    return shape_key(model=name, dtype=dtype, quantization=quantization or "checkpoint")


def tuned_budget(model: str | None, dtype: str, quantization: str | None,
                 device: str | torch.device = "cpu") -> int | None:
    """The measured max_num_batched_tokens for these settings on this device, or None."""
    entry = lookup(BUDGET_OP, budget_key(model, dtype, quantization), device)
    try:
        return int(entry["best"]) if entry else None
    except (KeyError, TypeError, ValueError):
        return None


# The `cpu` attention backend's bf16 prefill rows have two paths: kiln's tiled kernel
# and SDPA over gathered blocks. `kiln bench kernels --ops attention` times the second
# as this candidate beside "cpu" (the kernel) on every prefill shape.
CPU_SDPA = "cpu-sdpa"


def prefill_kernel_wins(device: str | torch.device = "cpu") -> bool | None:
    """Whether the kernel's total over the bf16 prefill shapes timed with both paths is
    the lower; None without such entries. Measured: on Zen 4 the kernel won 2.4x at 2,000
    tokens; on a Xeon capped to AVX512-BF16, SDPA won 2.2x (with AMX tiles the kernel won
    1.7x)."""
    times = times_by_shape(device_entries("attention", device), torch.bfloat16,
                           lambda d: (d["phase"], d["heads"], d["kv_heads"], d["head_size"]),
                           "tokens")  # decode shapes have no token count: skipped
    kernel = sdpa = 0.0
    for by_tokens in times.values():
        for us in by_tokens.values():
            if "cpu" in us and CPU_SDPA in us:
                kernel += float(us["cpu"])
                sdpa += float(us[CPU_SDPA])
    return None if kernel == sdpa == 0.0 else kernel <= sdpa
