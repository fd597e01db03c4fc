"""kiln vs its peers on this machine, side by side, one engine process at a time.

    python benchmarks/peers/run.py [--peers vllm,transformers] [--dtype bfloat16] [--quick]
                                   [--json PATH] [--kiln-args "-O1"] [--venv-dir DIR]
                                   [--rounds N]

Run it with kiln's python (kiln importable). For each engine, in order kiln, vLLM CPU,
transformers fp32, transformers bf16: one warm-up process (fills kiln's compile cache,
vLLM's torch.compile cache and the page cache), then one measured process that reports
start-up time, batch-1 decode tok/s and N-request throughput (protocol: measure.py).
`--rounds N` measures every engine N times, round after round, and reports medians plus
each round's batch-1 ratios.
Peers are installed on first use in their own venvs outside the repository (install.py).
An engine that fails to install or run becomes a row with its error.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import install  # noqa: E402  (a sibling script, not a package)
from busy import cpu_busy  # noqa: E402
from measure import MARKER, Spec  # noqa: E402
from table import Row, combine, format_rounds, format_table, to_json  # noqa: E402


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One row: which worker, with which python, at which dtype."""

    engine: str
    dtype: str
    worker: str
    peer_env: str | None = None  # a venv from install.PEER_ENVS; None: this python
    needs: str | None = None     # a module this python must have (checked up front)
    options: dict[str, Any] = field(default_factory=dict)


def kiln_runs(args: argparse.Namespace) -> list[EngineRun]:
    """One kiln row per `--kiln-run LABEL=ARGS` (default: one row, `--kiln-args`). In ARGS
    `@gguf` stands for the embedded model's GGUF file (run natively, Q4_1)."""
    from kiln.models.model_source import default_gguf_path

    specs = args.kiln_run or [f"{args.kiln_dtype}={args.kiln_args}"]
    runs = []
    for item in specs:
        label, _, extra = item.partition("=")
        argv = [str(default_gguf_path()) if a == "@gguf" else a for a in shlex.split(extra)]
        runs.append(EngineRun("kiln", label, "worker_kiln.py",
                              options={"argv": argv, "dtype": args.kiln_dtype}))
    return runs


def plan(args: argparse.Namespace) -> list[EngineRun]:
    from kiln.models.model_source import default_gguf_path

    runs = kiln_runs(args)
    for peer in args.peers:
        if peer == "vllm":
            runs.append(EngineRun("vllm", args.dtype, "worker_vllm.py", peer_env="vllm",
                                  options={"engine_kwargs": json.loads(args.vllm_kwargs)}))
        elif peer == "llamacpp":
            runs.append(EngineRun("llama.cpp", "q4_1", "worker_llamacpp.py",
                                  peer_env="llamacpp",
                                  options={"gguf": str(default_gguf_path())}))
        elif peer == "transformers":
            runs += [EngineRun("transformers", d, "worker_transformers.py",
                               needs="transformers") for d in args.hf_dtypes]
        else:
            raise SystemExit(f"unknown peer {peer!r}: choose from vllm, llamacpp, "
                             "transformers")
    return runs


def make_spec(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every engine gets the same prompts: random token ids from kiln's bench workload
    (exact lengths, all distinct, so no prefix-cache hits)."""
    from kiln.bench.workload import random_prompts

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return random_prompts([length] * n, vocab, rng)

    return asdict(Spec(model=str(model), dtype="", new_tokens=args.new_tokens,
                       startup_prompt=prompts(1, 8)[0], warmup_prompts=prompts(4, 16),
                       batch1_prompts=prompts(2 * args.repeats, args.b1_input_len),
                       batchn_prompts=prompts(args.num_prompts, args.input_len)))


def run_process(python: str, run: EngineRun, spec: dict[str, Any], log: Path,
                timeout: float, clean_env: bool, threads: int | None) -> dict[str, Any]:
    """Run one worker process to completion; its parsed result (or an error dict)."""
    spec_path = log.with_suffix(".spec.json")
    dtype = run.options.get("dtype", run.dtype)  # a kiln row's label is not its dtype
    spec_path.write_text(json.dumps({**spec, "dtype": dtype, "options": run.options}))
    env = dict(os.environ)
    if clean_env:  # a peer venv must not see kiln's tree on PYTHONPATH
        env.pop("PYTHONPATH", None)
    if threads:  # smoke tests on a busy machine only: the default is each engine's own
        env["OMP_NUM_THREADS"] = str(threads)
    env["PEERS_T0"] = repr(time.monotonic())  # host-wide, never jumps
    with open(log, "w") as out:
        # A session of its own, so a timeout can end the worker and its children (vLLM's
        # engine core process) together.
        proc = subprocess.Popen([python, str(HERE / run.worker), str(spec_path)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=log.parent,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_session(proc.pid)
            proc.wait()
            return {"error": f"timed out after {timeout:.0f} s; log {log}"}
        _end_session(proc.pid)  # a leftover child would load the CPUs for the next engine
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.startswith(MARKER)]
    if not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}, no result line; log {log}: "
                         + " | ".join(tail)}
    return json.loads(lines[-1][len(MARKER):])


def _end_session(pid: int) -> None:
    """Kill what is left of the worker's own process group (only processes it started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python_for(run: EngineRun, args: argparse.Namespace, logs: Path) -> str:
    if run.peer_env is None:
        if run.needs and importlib.util.find_spec(run.needs) is None:
            raise RuntimeError(f"{run.needs} is not installed in {sys.executable}")
        return sys.executable
    if not args.install and not install.is_installed(run.peer_env, args.venv_dir):
        raise RuntimeError(f"not installed; run `python benchmarks/peers/install.py "
                           f"{run.peer_env}` or drop --no-install")
    if not install.is_installed(run.peer_env, args.venv_dir):
        print(f"[{run.engine}] installing into {args.venv_dir / run.peer_env} (several "
              f"minutes; log {logs / (run.peer_env + '-install.log')})", flush=True)
    return str(install.install(run.peer_env, args.venv_dir,
                               logs / f"{run.peer_env}-install.log"))


def measure_engine(run: EngineRun, spec: dict[str, Any], args: argparse.Namespace,
                   logs: Path, round_: int = 0) -> Row:
    name = f"{run.engine}-{run.dtype}" + (f"-round{round_}" if round_ else "")
    try:
        python = python_for(run, args, logs)
    except RuntimeError as exc:
        return Row(engine=run.engine, dtype=run.dtype, error=f"install: {exc}")
    clean = run.peer_env is not None
    if args.warmup and round_ == 0:  # later rounds find the caches warm
        t0 = time.monotonic()
        warm = run_process(python, run, {**spec, "startup_only": True},
                           logs / f"{name}-warmup.log", args.timeout, clean, args.threads)
        print(f"[{run.engine} {run.dtype}] warm-up process: {time.monotonic() - t0:.0f} s"
              + (f" ({warm['error']})" if "error" in warm else ""), flush=True)
    busy = cpu_busy()  # nothing of ours runs now: this is everyone else's load
    t0 = time.monotonic()
    result = run_process(python, run, spec, logs / f"{name}.log", args.timeout, clean,
                         args.threads)
    print(f"[{run.engine} {run.dtype}] measured process: {time.monotonic() - t0:.0f} s"
          + (f" (CPUs {busy:.0%} busy before it)" if busy is not None else ""), flush=True)
    row = Row.from_result(run.engine, run.dtype, result)
    row.cpu_busy_before = busy
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=lambda s: [p for p in s.split(",") if p],
                    default=["vllm", "transformers"], help="comma list: vllm,llamacpp,transformers")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (default bfloat16)")
    ap.add_argument("--hf-dtypes", type=lambda s: s.split(","),
                    default=["float32", "bfloat16"], help="transformers rows")
    ap.add_argument("--kiln-dtype", default="auto")
    ap.add_argument("--kiln-args", default="", help="extra kiln engine flags, e.g. '-O1'")
    ap.add_argument("--kiln-run", action="append", default=None, metavar="LABEL=ARGS",
                    help="a kiln row (repeatable), e.g. 'q4_1=--model @gguf' (the embedded "
                         "GGUF file, native) or 'int8=--quantization int8'")
    ap.add_argument("--vllm-kwargs", default="{}", help="JSON: extra vllm.LLM kwargs")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--b1-input-len", type=int, default=32, help="batch-1 prompt length")
    ap.add_argument("--input-len", type=int, default=128, help="batch-N prompt length")
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 repeats (median)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every engine this many times, round after round (one "
                         "warm-up each, in the first), and report medians and each "
                         "round's ratios: on a host whose speed drifts between engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 8 new tokens, 4 requests, 1 repeat")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--no-install", dest="install", action="store_false")
    ap.add_argument("--venv-dir", type=Path, default=install.default_venv_dir())
    ap.add_argument("--threads", type=int, default=None,
                    help="set OMP_NUM_THREADS for every engine (smoke tests on a busy "
                         "machine; leave unset for the real comparison)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens, args.num_prompts, args.repeats = 8, 4, 1
        args.b1_input_len, args.input_len = 16, 32
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kiln.models.model_source import resolve_model

    model = resolve_model(None)
    spec = make_spec(model, args)
    logs = args.venv_dir / "logs" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; logs in {logs}", flush=True)
    t0 = time.monotonic()
    runs = plan(args)
    rounds = [[measure_engine(r, spec, args, logs, i) for r in runs] for i in range(args.rounds)]
    rows = combine(rounds)
    print(f"\nSmolLM2-135M-Instruct, greedy, {args.new_tokens} new tokens per request; "
          f"batch 1 (prompt {args.b1_input_len}) and {args.num_prompts} requests at once "
          f"(prompt {args.input_len}); {os.cpu_count()} CPUs; "
          f"{time.monotonic() - t0:.0f} s in all.")
    print("kiln/... columns: how many times kiln is better (tok/s: kiln/peer; start-up: "
          "peer/kiln)\n")
    print(format_table(rows, args.num_prompts, args.new_tokens))
    if args.rounds > 1:
        print(f"(medians of {args.rounds} rounds)\n" + format_rounds(rounds))
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps({"config": config, "model": str(model),
                                               "logs": str(logs), "rows": to_json(rows)},
                                              indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
