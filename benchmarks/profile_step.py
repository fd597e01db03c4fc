"""Where a decode step's time goes: `python benchmarks/profile_step.py [--batch N]`.

Runs the default model (CLI defaults unless flags say otherwise), warms up, then profiles
`--steps` decode steps with torch.profiler and prints milliseconds per step by category:

  linear     weight matmuls (kiln's packed kernel, aten mm/addmm/linear, oneDNN)
  attention  the attention op, including what runs inside it
  compiled   the rest of the compiled graph (Inductor's fused norms, RoPE, SiLU, adds)
  sampling   the sampler's argmax / top-k / sort
  other      everything else: engine Python (scheduler, input preparation, detokenizer)

"other" is the step's wall time minus the categorised time, so it includes the profiler's
own overhead (a few percent). Used for the before/after table in the README.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

# Self time of these (leaf kernels and their thin wrappers: nothing counted twice) ...
LINEAR_OPS = ("kiln_cpu::linear_packed", "aten::mm", "aten::addmm", "aten::linear",
              "aten::matmul", "mkldnn::_linear_pointwise")
# ... and total time of these (everything inside them).
TOTAL_OPS = {"attention": ("kiln::unified_attention", "kiln_cpu::unified_attention"),
             "sampling": ("aten::argmax", "aten::topk", "aten::sort")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-O", dest="level", type=int, default=2)
    args = ap.parse_args()

    from kiln import LLM, SamplingParams

    llm = LLM(None, dtype=args.dtype, optimization_level=args.level, progress=False)
    prompts = [{"prompt_token_ids": [1] + [100 + i + j for j in range(31)]}
               for i in range(args.batch)]
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    engine.step()  # the prefill step, not profiled
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - start) * 1e3 / args.steps
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    per_step = 1e3 * args.steps
    totals = {"linear": sum(e.self_cpu_time_total for e in events if e.key in LINEAR_OPS)
              / per_step}
    for name, ops in TOTAL_OPS.items():
        totals[name] = sum(e.cpu_time_total for e in events if e.key in ops) / per_step
    totals["compiled"] = sum(e.self_cpu_time_total for e in events
                             if e.key.startswith("## Call CompiledFxGraph")) / per_step
    totals["other"] = max(0.0, wall - sum(totals.values()))
    dtype = engine.dtype
    print(f"decode step, batch {args.batch}, {dtype}, -O{args.level}: {wall:.1f} ms/step "
          f"({1e3 * args.batch / wall:.1f} tok/s under the profiler)")
    for name, ms in totals.items():
        print(f"  {name:<10} {ms:6.1f} ms  {100 * ms / wall:5.1f}%")


if __name__ == "__main__":
    main()
