"""Tensor parallel sizes side by side on one model, with the per-step costs of the
transport:

    python benchmarks/tensor_parallel.py [--model DIR] [--tp 1 2] [-O 2] [--dtype float32]
        [--new-tokens 64] [--requests 32]

For each size: batch-1 decode speed (one prompt, `--new-tokens` greedy tokens) and the
output rate with `--requests` prompts at once; then, per engine step, the engine's time
in the broadcast of the scheduler output (mp only) and each rank's time inside
all-reduces (calls per step, ms per call). Ratios are against the first size. Sizes run
one after another in this process (each is its own set of worker processes).
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
    broadcast = getattr(llm.engine.executor, "broadcast_s", None)
    out["broadcast_ms_per_step"] = None if broadcast is None else 1e3 * broadcast / steps
    return out


def run(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    llm = LLM(args.model, dtype=args.dtype, optimization_level=args.O, progress=False,
              tensor_parallel_size=tp, max_model_len=512)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    _measure(llm, [prompt], 4)  # warm: first-step allocations, graph dispatch
    b1 = _measure(llm, [prompt], args.new_tokens)
    batch = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.requests)]
    many = _measure(llm, batch, args.new_tokens)
    comm = _comm(llm)
    llm.shutdown()
    return {"tp": tp, "b1": b1, "many": many, **comm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-O", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    rows = [run(args, tp) for tp in args.tp]
    base = rows[0]
    print(f"\nmodel {args.model or 'SmolLM2-135M'}, {args.dtype}, -O{args.O}, "
          f"{args.new_tokens} new tokens; tok/s (ratio vs tp={base['tp']})")
    print(f"{'tp':>3} {'batch 1':>16} {f'{args.requests} requests':>18} {'step ms':>8} "
          f"{'bcast ms/step':>13} {'all-reduce/step':>15} {'all-reduce ms/step per rank'}")
    for r in rows:
        bcast = "-" if r["broadcast_ms_per_step"] is None else f"{r['broadcast_ms_per_step']:.2f}"
        ar = ", ".join(f"{x:.2f}" for x in r["all_reduce_ms_per_step"])
        print(f"{r['tp']:>3} {r['b1']:>8.1f} ({r['b1'] / base['b1']:.2f}x) "
              f"{r['many']:>9.1f} ({r['many'] / base['many']:.2f}x) {r['step_ms']:>8.1f} "
              f"{bcast:>13} {r['all_reduce_per_step']:>15.0f} {ar}")


if __name__ == "__main__":
    main()
