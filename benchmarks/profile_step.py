"""Where a step's time goes: `python benchmarks/profile_step.py [--batch N | --prefill N]`.

Runs the default model (CLI defaults unless flags say otherwise), warms up, then profiles
`--steps` decode steps (or, with `--prefill N`, the prefill step of one N-token prompt,
best of `--steps`) with torch.profiler and prints milliseconds per step by category:

  linear     weight matmuls (kiln's packed kernel, aten mm/addmm/linear, oneDNN; a gate_up
             GEMM with its SiLU or the QKV GEMM with its RoPE fused counts here whole), with
             whatever runs inside them (a per-call weight copy shows here, and by name
             on the "inside linear" line)
  attention  the attention op, including what runs inside it
  pointwise  kiln's own SiLU-and-mul, RoPE and add-RMSNorm kernels (bf16 on the CPU)
  compiled   the rest of the compiled graph (Inductor's fused norms, RoPE, SiLU, adds)
  sampling   the sampler's argmax (kiln's greedy kernel or ATen's) / top-k / sort
  other      everything else: engine Python (scheduler, input preparation, detokenizer)

"other" is the step's wall time minus the categorised time, so it includes the profiler's
own overhead (a few percent). Used for the before/after tables in docs/.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

# Total time (children included: a weight copy inside a linear counts as linear) of the
# outermost call of each of these; a call nested in another one of its group is not counted
# again.
TOTAL_OPS = {"linear": ("kiln_cpu::linear_packed", "kiln_cpu::linear_quant",
                        "kiln_cpu::linear_packed_silu", "kiln_cpu::linear_quant_silu",
                        "kiln_cpu::linear_packed_rope",
                        "aten::linear", "aten::matmul", "aten::mm",
                        "aten::addmm", "mkldnn::_linear_pointwise"),
             "attention": ("kiln::unified_attention", "kiln_cpu::unified_attention"),
             "pointwise": ("kiln_cpu::silu_and_mul", "kiln_cpu::rotary_embedding",
                           "kiln_cpu::add_rms_norm"),
             "sampling": ("kiln_cpu::greedy_argmax", "aten::argmax", "aten::topk",
                          "aten::sort")}


def outermost_total_us(events, names: tuple[str, ...]) -> float:
    total = 0.0
    for e in events:
        if e.name not in names:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in names:
            parent = parent.cpu_parent
        if parent is None:
            total += e.cpu_time_total
    return total


def top_children(events, names: tuple[str, ...], n: int = 4) -> str:
    """The ops taking most self time inside `names` calls (e.g. a weight copy)."""
    inside: dict[str, float] = {}
    for e in events:
        parent = e.cpu_parent
        while parent is not None and parent.name not in names:
            parent = parent.cpu_parent
        if parent is not None or e.name in names:
            inside[e.name] = inside.get(e.name, 0.0) + e.self_cpu_time_total
    return ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in
                     sorted(inside.items(), key=lambda kv: -kv[1])[:n])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-O", dest="level", type=int, default=2)
    ap.add_argument("-q", "--quantization", default=None, help="int8 | gguf | none")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 (GGUF)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="profile the prefill of one N-token prompt instead of decode steps")
    args = ap.parse_args()

    from kiln import LLM, SamplingParams

    budget = {"max_num_batched_tokens": max(2048, args.prefill),
              "max_model_len": max(2048, args.prefill + 8)} if args.prefill else {}
    llm = LLM(args.model, dtype=args.dtype, optimization_level=args.level, progress=False,
              quantization=args.quantization, **budget)
    if args.prefill:
        return profile_prefill(llm, args)
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
    print(f"decode step, batch {args.batch}, {engine.dtype}, -O{args.level}: {wall:.1f} "
          f"ms/step ({1e3 * args.batch / wall:.1f} tok/s under the profiler)")
    report(prof, wall, args.steps)


def report(prof, wall_ms: float, steps: int) -> None:
    """Milliseconds per step by category (see the module's docstring)."""
    events = prof.events()
    per_step = 1e3 * steps
    totals = {name: outermost_total_us(events, ops) / per_step
              for name, ops in TOTAL_OPS.items()}
    totals["compiled"] = sum(e.self_cpu_time_total for e in prof.key_averages()
                             if e.key.startswith("## Call CompiledFxGraph")) / per_step
    totals["other"] = max(0.0, wall_ms - sum(totals.values()))
    for name, ms in totals.items():
        print(f"  {name:<10} {ms:6.1f} ms  {100 * ms / wall_ms:5.1f}%")
    print(f"  inside linear, all steps (self time): "
          f"{top_children(events, TOTAL_OPS['linear'])}")


def profile_prefill(llm, args) -> None:
    """The fastest of `--steps` prefills of one fresh prompt (no prefix hit), profiled
    one at a time; the report is that fastest step's."""
    from prefill_ttft import prompt  # this directory's script (sys.path[0])

    from kiln import SamplingParams

    engine, one = llm.engine, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    best = None
    for i in range(args.steps + 1):  # the first one warms up
        # A new prompt each time: nothing hits the prefix cache.
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt(args.prefill, i)}, one)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - start) * 1e3
        while engine.has_unfinished_requests():
            engine.step()
        if i and (best is None or wall < best[0]):
            best = wall, prof
    wall, prof = best
    print(f"prefill of {args.prefill} tokens, {engine.dtype}, -O{args.level}: {wall:.1f} ms "
          f"({1e3 * args.prefill / wall:.0f} tok/s under the profiler)")
    report(prof, wall, 1)


if __name__ == "__main__":
    main()
