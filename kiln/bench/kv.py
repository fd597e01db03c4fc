"""`kiln bench kv` and `kiln bench pd`: the KV connector's two promises, measured.

kv: time to first token of a request with a long shared prefix (`--prefix-len`, default
1,500 tokens of the public-domain text in bench/data, then a short question that differs
per run) in a *fresh process*, three ways, interleaved `--repeats` times after one run
that fills the tier:
  none   no connector (the prefix is computed)
  warm   the disk tier holds the prefix (loaded, then only the question is computed)
  cold   the disk tier is empty: computed and saved (the cost of saving), run once
TTFT is the greedy one-token request after the engine is built (start-up is reported
apart). JSON: mode "kv", environment, config, runs {case: [probe results]},
median_ttft_s, speedup (none / warm), save_overhead (cold / none).

pd: P/D disaggregation on this host vs one instance, as servers: a prefill and a decode
`kiln serve` joined by the torch_distributed connector, behind `kiln serve --pd-proxy`,
then one plain server; each loaded by `kiln bench serve`'s client (`--num-prompts`
streams at once, `--max-concurrency` 16 by default). JSON: mode "pd", environment, config,
pd and single (each `kiln bench serve`'s result), ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.bench.report import environment, table
from kiln.bench.server_proc import ServerProcess, free_port

_TEXT = (Path(__file__).parent / "data" / "declaration.txt").read_text()


def _tier_config(path: Path) -> str:
    return json.dumps({"kv_connector": "disk", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"path": str(path)}})


def run_kv(engine_argv: list[str], prefix_len: int, repeats: int,
           timeout_s: float = 900.0) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="kiln-kv-bench-") as tmp:
        tier = ["--kv-transfer-config", _tier_config(Path(tmp))]
        runs["cold"].append(_probe([*engine_argv, *tier], prefix_len, 0, timeout_s))
        for r in range(1, repeats + 1):
            runs["none"].append(_probe(engine_argv, prefix_len, r, timeout_s))
            runs["warm"].append(_probe([*engine_argv, *tier], prefix_len, r, timeout_s))
    med = {case: statistics.median(p["ttft_s"] for p in probes)
           for case, probes in runs.items()}
    same = all(p["first_token"] == q["first_token"]
               for p, q in zip(runs["none"], runs["warm"]))
    return {"mode": "kv", **environment(),
            "config": {"engine_args": engine_argv, "prefix_len": prefix_len,
                       "repeats": repeats},
            "runs": runs, "median_ttft_s": med, "speedup": med["none"] / med["warm"],
            "save_overhead": med["cold"] / med["none"], "identical": same}


def _probe(argv: list[str], prefix_len: int, seed: int, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kiln.bench.kv", *argv, "--prefix-len", str(prefix_len),
           "--question", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"kv probe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe_main(argv: list[str] | None = None) -> int:
    """The child: build the engine, time one request's first token, print JSON."""
    from kiln.entrypoints.args import add_engine_args, make_llm
    from kiln.sampling.params import SamplingParams

    parser = argparse.ArgumentParser(prog="kiln.bench.kv")
    add_engine_args(parser)
    parser.add_argument("--prefix-len", type=int, required=True)
    parser.add_argument("--question", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    llm = make_llm(args)
    load_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    ids = tok.encode(_TEXT * (1 + 4 * args.prefix_len // len(_TEXT)))
    question = f"\n\nQuestion {args.question}: what is this text about?"
    prompt = ids[: args.prefix_len] + tok.encode(question)
    t1 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t1
    llm.engine.flush_kv_saves()
    kt = llm.engine.get_stats().kv_transfer
    print(json.dumps({"load_s": load_s, "ttft_s": ttft, "prompt_tokens": len(prompt),
                      "first_token": out[0].outputs[0].token_ids,
                      "kv_transfer": kt.as_dict() if kt else None}))
    return 0


def format_kv(r: dict[str, Any]) -> str:
    c, med = r["config"], r["median_ttft_s"]
    rows = []
    for case in ("none", "cold", "warm"):
        probes = r["runs"][case]
        kt = probes[-1]["kv_transfer"] or {}
        rows.append([case, f"{med[case] * 1e3:.0f}",
                     " ".join(f"{p['ttft_s'] * 1e3:.0f}" for p in probes),
                     f"{statistics.median(p['load_s'] for p in probes):.1f}",
                     f"{kt.get('blocks_loaded', 0):.0f}",
                     f"{kt.get('load_time_s', 0) * 1e3:.1f}"])
    head = (f"kv: TTFT of a {c['prefix_len']}-token shared prefix + a question, fresh "
            f"process per run, {c['repeats']} interleaved repeats")
    body = table(["case", "TTFT ms (median)", "runs", "engine start s",
                  "blocks loaded", "read+verify ms"], rows)
    tail = (f"warm tier vs none: {r['speedup']:.2f}x faster TTFT | saving costs "
            f"{r['save_overhead']:.2f}x none | first tokens identical: {r['identical']}")
    return "\n".join([head, body, tail])


# ---- P/D -------------------------------------------------------------------------------
def run_pd(engine_argv: list[str], num_prompts: int, input_len: int, output_len: int,
           max_concurrency: int, split_cpus: bool = True,
           timeout_s: float = 900.0) -> dict[str, Any]:
    """P, D and the proxy first, then one plain server (never both at once). With
    `split_cpus` P and D each get half of this host's CPUs (as P/D deployments pin them);
    the single instance gets all of them."""
    from kiln.bench.serve import run_serve

    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    p_cpus, d_cpus = (cpus[:half], cpus[half:]) if split_cpus and half else (cpus, cpus)
    kv_port = free_port()
    load = dict(max_concurrency=max_concurrency, request_timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="kiln-pd-bench-") as tmp:
        logs = Path(tmp)
        p = ServerProcess(engine_argv + _pd_kv("kv_producer", kv_port), logs / "p.log", p_cpus)
        d = ServerProcess(engine_argv + _pd_kv("kv_consumer", kv_port), logs / "d.log", d_cpus)
        proxy = ServerProcess(["--pd-proxy", p.url, d.url], logs / "proxy.log", None)
        try:
            for s in (p, d, proxy):
                s.wait_ready(timeout_s)
            pd = run_serve(proxy.url, num_prompts, input_len, output_len, **load)
            pd["decode_metrics"] = d.kv_metrics()
        finally:
            for s in (proxy, p, d):
                s.stop()
        single = ServerProcess(engine_argv, logs / "single.log", cpus)
        try:
            single.wait_ready(timeout_s)
            one = run_serve(single.url, num_prompts, input_len, output_len, **load)
        finally:
            single.stop()
    ratios = {f"{k}_{q}": _ratio(pd[k], one[k], q) for k in ("ttft_ms", "itl_ms")
              for q in ("p50", "p99")}
    ratios["output_tok_s"] = (pd["output_tok_s"] or 0) / (one["output_tok_s"] or 1)
    return {"mode": "pd", **environment(),
            "config": {"engine_args": engine_argv, "num_prompts": num_prompts,
                       "input_len": input_len, "output_len": output_len,
                       "max_concurrency": max_concurrency, "p_cpus": p_cpus,
                       "d_cpus": d_cpus},
            "pd": pd, "single": one, "ratios": ratios}


def _ratio(a: dict[str, Any], b: dict[str, Any], q: str) -> float | None:
    return a[q] / b[q] if a.get(q) and b.get(q) else None


def _pd_kv(role: str, port: int) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "torch_distributed", "kv_role": role, "kv_port": port})]


def format_pd(r: dict[str, Any]) -> str:
    c = r["config"]
    rows = []
    for name, res in (("P/D (proxy)", r["pd"]), ("one instance", r["single"])):
        t, i = res["ttft_ms"], res["itl_ms"]
        rows.append([name, f"{t.get('p50') or 0:.0f}", f"{t.get('p99') or 0:.0f}",
                     f"{i.get('p50') or 0:.1f}", f"{i.get('p99') or 0:.1f}",
                     f"{res['output_tok_s'] or 0:.1f}", f"{res['completed']}"])
    head = (f"pd: {c['num_prompts']} streams (max {c['max_concurrency']} at once), input "
            f"{c['input_len']}, output {c['output_len']}; P on CPUs {c['p_cpus']}, D on "
            f"{c['d_cpus']}")
    body = table(["setup", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                  "output tok/s", "ok"], rows)
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items() if v is not None)
    loaded = r["pd"]["decode_metrics"].get("kiln:kv_transfer_blocks_loaded_total", 0)
    tail = f"P/D / one: {ratios} | D loaded {loaded:.0f} blocks from P"
    return "\n".join([head, body, tail])


if __name__ == "__main__":
    raise SystemExit(probe_main())
