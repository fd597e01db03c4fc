"""`kiln bench kernels`: time candidate implementations of the hot ops, keep the fastest.

For every op and shape (see cases.py and kernel_attention.py) each candidate is checked
against the reference (the first candidate) and then timed; a candidate that fails or
disagrees is reported and never chosen. The winners go into the tuning table
(tuning.py), keyed by device name and shape, which the engine reads at start-up: the
attention backend when none is named, each bf16 linear's kernel (kiln/ops/linear_plan.py),
each quantized linear's panel row count and each MoE block's expert kernel
(kiln/moe/cpu_plan.py).

JSON (`--json`), units in the field names:
    mode "kernels", environment, config {model, dtype, ops, decode_batches, prefill_lens,
    context_len, compiled, warmup, iters}, tuning_file,
    results: [{op, shape, candidate, label (candidate plus its config), config, ok, error,
    median_us, p90_us (per call), calls_per_sample}],
    best: {op: {shape: {best, config, us: {candidate label: median_us}}}} (what was written
    to the tuning table).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kiln.bench import plots
from kiln.bench.cases import (Case, Shapes, rms_norm_cases, rope_cases, sampler_cases,
                              silu_and_mul_cases)
from kiln.bench.cases_linear import linear_cases
from kiln.bench.cases_moe import fused_moe_cases
from kiln.bench.cases_quant import linear_quant_cases
from kiln.bench.kernel_attention import attention_cases
from kiln.bench.report import environment, table
from kiln.bench.stats import percentile
from kiln.bench.tuning import merge_into
from kiln.ops.tuning import parse_key

OPS: dict[str, Callable[[Shapes, bool], list[Case]]] = {
    "linear": linear_cases, "linear_quant": linear_quant_cases, "fused_moe": fused_moe_cases,
    "attention": attention_cases, "rms_norm": rms_norm_cases, "rope": rope_cases,
    "silu_and_mul": silu_and_mul_cases, "top_k_top_p": sampler_cases}

_MIN_SAMPLE_S = 2e-4  # batch tiny ops so one timed sample is well above timer resolution


def measure(fn: Callable[[], Any], device: torch.device, warmup: int,
            iters: int) -> tuple[float, float, int]:
    """(median, p90) seconds per call and the calls per timed sample."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(1, warmup)):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    calls = max(1, int(_MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return percentile(samples, 50), percentile(samples, 90), calls


@torch.inference_mode()
def run_kernels(shapes: Shapes, ops: Sequence[str], *, compiled: bool = True,
                warmup: int = 3, iters: int = 20, tuning_file: str | Path | None = None,
                model: str | None = None) -> dict[str, Any]:
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops {unknown} are unknown; choose from {', '.join(OPS)}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    results: list[dict[str, Any]] = []
    best: dict[str, dict[str, dict[str, Any]]] = {}
    for op in ops:
        for case in OPS[op](shapes, compiled):
            rows = _run_case(case, shapes.device, warmup, iters)
            results.extend(rows)
            good = [r for r in rows if r["ok"]]
            if good:
                win = min(good, key=lambda r: r["median_us"])
                best.setdefault(op, {})[case.key] = {
                    "best": win["candidate"], "config": win["config"],
                    "us": {r["label"]: r["median_us"] for r in good}}
    env = environment(str(shapes.device))
    written = merge_into(tuning_file, env["device"], best) if tuning_file else None
    return {"mode": "kernels", **env,
            "config": {"model": model, "dtype": str(shapes.dtype).removeprefix("torch."),
                       "ops": list(ops), "decode_batches": list(shapes.decode_batches),
                       "prefill_lens": list(shapes.prefill_lens),
                       "context_len": shapes.context_len, "compiled": compiled,
                       "warmup": warmup, "iters": iters},
            "tuning_file": str(written) if written else None,
            "results": results, "best": best}


def _run_case(case: Case, device: torch.device, warmup: int, iters: int) -> list[dict]:
    rows, reference = [], None
    for cand in case.candidates:
        row = {"op": case.op, "shape": case.key, "candidate": cand.name, "label": cand.label,
               "config": cand.config, "ok": False, "error": None, "median_us": None,
               "p90_us": None, "calls_per_sample": None}
        rows.append(row)
        try:
            out = cand.run()
            if reference is None:
                reference = out  # the first candidate is the reference
            elif (err := case.compare(reference, out)) is not None:
                row["error"] = f"wrong result: {err}"
                continue
            med, p90, calls = measure(cand.run, device, warmup, iters)
        except Exception as exc:  # a candidate that cannot run here is skipped, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        row.update(ok=True, median_us=med * 1e6, p90_us=p90 * 1e6, calls_per_sample=calls)
    return rows


def format_kernels(r: dict[str, Any]) -> str:
    head = (f"kernels: {r['device']}, {r['config']['dtype']}, median of "
            f"{r['config']['iters']} samples")
    rows = []
    for x in r["results"]:
        win = r["best"].get(x["op"], {}).get(x["shape"], {})
        mark = "*" if x["ok"] and win.get("best") == x["candidate"] \
            and win.get("config") == x["config"] else ""
        rows.append([x["op"], x["shape"], x["label"] + mark,
                     x["median_us"] if x["ok"] else None, x["p90_us"] if x["ok"] else None,
                     x["error"] or ""])
    body = table(("op", "shape", "candidate (* fastest)", "median us", "p90 us", "note"),
                 rows, digits=1)
    tail = f"tuning table: {r['tuning_file']}" if r["tuning_file"] else "tuning table: not written"
    return "\n".join([head, body, tail])


def plot_kernels(r: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    for op in r["config"]["ops"]:
        groups: dict[str, dict[str, float]] = {}
        for x in r["results"]:
            if x["op"] == op and x["ok"]:
                groups.setdefault(x["shape"], {})[x["label"]] = x["median_us"]
        if not groups:
            continue
        times = [t for g in groups.values() for t in g.values()]
        named = dict(zip(_short_keys(list(groups)), groups.values()))
        paths.append(plots.bars(named, f"kiln bench kernels: {op} ({r['device']})",
                                "median us per call", out_dir / f"kernels_{op}.png",
                                log=max(times) > 20 * min(times)))
    return paths


def _short_keys(keys: list[str]) -> list[str]:
    """Shape keys without the dimensions every key shares (they go unsaid on a chart)."""
    dims = [parse_key(k) for k in keys]
    names = list(dict.fromkeys(d for x in dims for d in x))  # union, first-seen order
    varying = [d for d in names if len({x.get(d) for x in dims}) > 1]
    if not varying:
        return keys
    return [",".join(f"{d}={x[d]}" for d in varying if d in x) for x in dims]
