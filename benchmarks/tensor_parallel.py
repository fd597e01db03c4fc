"""Tensor- and pipeline-parallel grids side by side on one model, with the per-step
costs of the transport:

    python benchmarks/tensor_parallel.py [--model DIR] [--grid 1x1 2x1 1x2] [-O 2]
        [--dtype float32] [--new-tokens 64] [--requests 32]

A grid is TPxPP (`--tp 1 2` alone means 1x1 2x1). For each: batch-1 decode speed (one
prompt, `--new-tokens` greedy tokens) and the output rate with `--requests` prompts at
once; then, per engine step, the engine's time handing the scheduler output to the
workers (mp only), each rank's time inside all-reduces, and for pipelines the bytes each
stage hands on, the first stage's time sending them and the last stage's time waiting for
them (which includes the earlier stages' compute). Ratios are against the first grid.
Grids run one after another in this process (each is its own set of worker processes).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from kiln import LLM, SamplingParams


def _measure(llm: LLM, prompts: list[dict], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _comm(llm: LLM) -> dict[str, Any]:
    stats = llm.engine.executor.collective_rpc("comm_stats")
    steps = max(1, stats[0]["steps"])
    out = {"steps": steps, "step_ms": 1e3 * stats[0]["step_s"] / steps,
           "all_reduce_per_step": stats[0]["all_reduce_calls"] / steps,
           "all_reduce_ms_per_step": [1e3 * s["all_reduce_s"] / steps for s in stats]}
    send = getattr(llm.engine.executor, "send_s", None)
    out["send_ms_per_step"] = None if send is None else 1e3 * send / steps
    first, last = stats[0], stats[-1]
    out["pp_kb_per_step"] = first.get("pp_bytes_sent", 0) / 1e3 / steps
    out["pp_send_ms_per_step"] = 1e3 * first.get("pp_send_s", 0.0) / steps
    out["pp_recv_wait_ms_per_step"] = 1e3 * last.get("pp_recv_wait_s", 0.0) / steps
    return out


def run(args: argparse.Namespace, tp: int, pp: int) -> dict[str, Any]:
    llm = LLM(args.model, dtype=args.dtype, optimization_level=args.O, progress=False,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, max_model_len=512)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    _measure(llm, [prompt], 4)  # warm: first-step allocations, graph dispatch
    b1 = _measure(llm, [prompt], args.new_tokens)
    batch = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.requests)]
    many = _measure(llm, batch, args.new_tokens)
    comm = _comm(llm)
    llm.shutdown()
    return {"grid": f"{tp}x{pp}", "b1": b1, "many": many, **comm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=None)
    ap.add_argument("--grid", nargs="+", default=None, metavar="TPxPP")
    ap.add_argument("-O", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    grid = args.grid or [f"{tp}x1" for tp in (args.tp or [1, 2])]
    rows = [run(args, *map(int, g.lower().split("x"))) for g in grid]
    base = rows[0]
    print(f"\nmodel {args.model or 'SmolLM2-135M'}, {args.dtype}, -O{args.O}, "
          f"{args.new_tokens} new tokens; tok/s (ratio vs {base['grid']})")
    print(f"{'tpxpp':>5} {'batch 1':>16} {f'{args.requests} requests':>18} {'step ms':>8} "
          f"{'send ms/step':>12} {'all-reduce/step':>15} {'all-reduce ms/step per rank':>27} "
          f"{'pp KB/step':>10} {'pp send ms':>10} {'pp wait ms':>10}")
    for r in rows:
        bcast = "-" if r["send_ms_per_step"] is None else f"{r['send_ms_per_step']:.2f}"
        ar = ", ".join(f"{x:.2f}" for x in r["all_reduce_ms_per_step"])
        print(f"{r['grid']:>5} {r['b1']:>8.1f} ({r['b1'] / base['b1']:.2f}x) "
              f"{r['many']:>9.1f} ({r['many'] / base['many']:.2f}x) {r['step_ms']:>8.1f} "
              f"{bcast:>12} {r['all_reduce_per_step']:>15.0f} {ar:>27} "
              f"{r['pp_kb_per_step']:>10.1f} {r['pp_send_ms_per_step']:>10.2f} "
              f"{r['pp_recv_wait_ms_per_step']:>10.2f}")


if __name__ == "__main__":
    main()
