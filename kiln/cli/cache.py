"""`kiln warmup` and `kiln cache ls | verify | clear`."""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from kiln.compiler.cache import (FACTORS, default_cache_root, read_verified_blob,
                                 verify_artifact)
from kiln.entrypoints.args import make_llm


def _root(args: argparse.Namespace) -> Path:
    return Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_root()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cmd_warmup(args: argparse.Namespace) -> int:
    """Build the engine (which compiles or loads every size and range) and report, per
    rank: with -tp N every rank warms its own cache entry."""
    if args.optimization_level == 0:
        args.optimization_level = 1  # warming a cache only makes sense when compiling
    start = time.perf_counter()
    llm = make_llm(args)
    elapsed = time.perf_counter() - start
    reports = llm.engine.executor.collective_rpc("compile_report")
    if not llm.engine.executor.is_driver:
        return 0  # under torchrun, rank 0 prints for everyone
    print(f"kiln warmup: {llm.engine.model_config.architecture}, {llm.engine.dtype}, "
          f"quantization {llm.engine.quantization.method or 'none'}, "
          f"-O{args.optimization_level}, {elapsed:.1f} s start-up")
    print(f"  start-up      {llm.engine.phases.describe()}")
    for rank, report in enumerate(reports):
        _print_report(report, rank, len(reports))
    return 0


def _print_report(r: dict[str, Any], rank: int, num_ranks: int) -> None:
    d = r["counters"]
    if num_ranks > 1:  # reports come in global rank order: pp_rank * tp + tp_rank
        stage = f" (pipeline stage {r['pp_rank']}, tp rank {r['tp_rank']})" \
            if r.get("pp_size", 1) > 1 else ""
        print(f" rank {rank} of {num_ranks}{stage}")
    print(f"  pieces        {d['num_piecewise_graphs_seen']} "
          f"({d['num_piecewise_capturable_graphs_seen']} compiled, "
          f"{d['num_unique_graphs']} unique graphs)")
    print(f"  sizes/ranges  {', '.join(r['shapes']) or '-'}")
    print(f"  builds        {d['num_backend_compilations']}: "
          f"{d['num_compiled_artifacts_loaded']} cache hits, "
          f"{d['num_inductor_compiles'] + d['num_eager_compiles']} compiled, "
          f"{d['num_cache_repairs']} repaired")
    print(f"  time          {r['compile_time_s']:.1f} s in the compiler")
    if r["cache_dir"] is not None:
        cache = Path(r["cache_dir"])
        count = len(list((cache / "artifacts").iterdir()))
        print(f"  cache         {cache} ({count} artifacts, {_size(cache) / 2**20:.1f} MiB)")


def cmd_cache(args: argparse.Namespace) -> int:
    root = _root(args)
    entries = sorted(p for p in root.iterdir() if (p / FACTORS).exists()) \
        if root.exists() else []
    if args.action == "clear":
        for entry in entries:
            shutil.rmtree(entry)
        print(f"removed {len(entries)} cache entries from {root}")
        return 0
    if not entries:
        print(f"no compile cache entries in {root}")
        return 0
    bad = 0
    for entry in entries:
        factors = json.loads((entry / FACTORS).read_text())
        # Dot-names are writers' temporary directories: in progress, or left by a killed
        # process (never loaded; the next writer of that artifact starts afresh).
        artifacts = sorted(p for p in (entry / "artifacts").iterdir()
                           if not p.name.startswith("."))
        model = factors.get("model_config", {})
        print(f"{entry.name}  {model.get('architecture')} L={model.get('num_layers')} "
              f"{factors.get('dtype')} shapes={','.join(factors.get('shapes', []))} "
              f"{len(artifacts)} artifacts {_size(entry) / 2**20:.1f} MiB")
        if args.action == "verify":
            if (entry / "graph.pkl").exists():
                intact = read_verified_blob(entry, "graph.pkl") is not None
                bad += not intact
                print(f"  {'ok ' if intact else 'BAD'} graph.pkl")
            for artifact in artifacts:
                problem = verify_artifact(artifact)
                bad += problem is not None
                print(f"  {'ok ' if problem is None else 'BAD'} {artifact.name}"
                      f"{'' if problem is None else ': ' + problem}")
    if bad:
        print(f"{bad} broken artifacts: they are rebuilt at the next start-up")
    return 1 if bad else 0
