"""`kiln bench compile`: cold vs warm start-up per optimization level.

For each level, two fresh processes run `kiln.bench.startup_probe` (start an engine,
generate one token). The first (cold) sees an empty kiln compile cache and an empty
Inductor cache, both in a new temporary directory; the second (warm) reuses them, as a
user's second start does. Every process pays Python and torch imports: that is part of a
real start-up, so it is measured, not subtracted.

JSON (`--json`), units in the field names:
    mode "compile", environment, config {levels, model, engine_args},
    rows: [{level, cold, warm, warm_over_cold}], where cold and warm are
    {process_s (spawn to exit), startup_s (spawn to first token), load_s (engine
    construction), first_token_s, artifacts_loaded, compiles} and warm_over_cold is
    warm.startup_s / cold.startup_s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from kiln.bench import plots
from kiln.bench.report import environment, table


def run_compile(levels: Sequence[int], engine_argv: list[str],
                timeout_s: float = 1800.0) -> dict[str, Any]:
    """`engine_argv`: engine flags for the probe, without -O and --cache-dir (set here)."""
    if not levels:
        raise ValueError("levels is empty: give at least one, e.g. --levels 0 1")
    bad = [lvl for lvl in levels if lvl not in (0, 1, 2, 3)]
    if bad:
        raise ValueError(f"levels={list(levels)}: {bad} are not optimization levels (0..3)")
    rows = []
    for level in levels:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-compile-") as tmp:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
            argv = [*engine_argv, f"-O{level}", "--cache-dir", str(Path(tmp) / "kiln")]
            cold = _probe(argv, env, timeout_s)
            warm = _probe(argv, env, timeout_s)
        rows.append({"level": level, "cold": cold, "warm": warm,
                     "warm_over_cold": warm["startup_s"] / cold["startup_s"]})
    return {"mode": "compile", **environment(),
            "config": {"levels": list(levels), "model": _flag(engine_argv, "--model"),
                       "engine_args": engine_argv},
            "rows": rows}


def _probe(argv: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    start = time.monotonic()
    env = {**env, "KILN_PROBE_T0": repr(start)}
    proc = subprocess.run([sys.executable, "-m", "kiln.bench.startup_probe", *argv],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ValueError(f"the start-up probe failed (exit {proc.returncode}) for engine "
                         f"args {' '.join(argv)}:\n{tail}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"process_s": elapsed, **report}


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def format_compile(r: dict[str, Any]) -> str:
    headers = ("level", "cold start (s)", "warm start (s)", "warm/cold", "cold load (s)",
               "warm load (s)", "cold compiles", "warm cache hits")
    rows = [[f"-O{x['level']}", x["cold"]["startup_s"], x["warm"]["startup_s"],
             x["warm_over_cold"], x["cold"]["load_s"], x["warm"]["load_s"],
             x["cold"]["compiles"], x["warm"]["artifacts_loaded"]] for x in r["rows"]]
    head = (f"compile: start-up to first token, fresh process each, model "
            f"{r['config']['model'] or 'default'} ({r['device']})")
    return "\n".join([head, table(headers, rows)])


def plot_compile(r: dict[str, Any], out_dir: Path) -> list[Path]:
    groups = {f"-O{x['level']}": {"cold": x["cold"]["startup_s"],
                                  "warm": x["warm"]["startup_s"]} for x in r["rows"]}
    return [plots.bars(groups, "kiln bench compile: spawn to first token", "seconds",
                       out_dir / "compile.png")]
