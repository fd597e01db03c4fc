"""Time to first token of one long prompt, in process: `python benchmarks/prefill_ttft.py`.

    python benchmarks/prefill_ttft.py [--lengths 512 2000] [--repeats 3] [-O 2]
                                      [--dtype auto] [--model DIR]
                                      [--vs-sdpa | --vs-all-rows]

One engine (the default model unless --model), one request at a time with max_tokens=1;
every prompt is new (distinct tokens, so no prefix-cache hit), and the first one of each
length warms up. Prints the best of --repeats per length. The token budget is raised to
the longest length so that each prompt is one prefill step. Cap the host's ISA with the
variables in ../shared/reference/this-machine.md to time another CPU class.

--vs-sdpa times the `cpu` attention backend's two prefill paths side by side in the same
engine, their repeats interleaved: kiln's tiled kernel (bf16; csrc/attention_prefill.h)
and SDPA over the gathered blocks (what ran before it), with the ratio. --vs-all-rows does
the same for the kept rows (kiln/runner/kept_rows.py): the last layer computing only the
sampled row after attention, against every row, as before it.

--gemm prints each length's rate in FLOP/s beside a bf16 `torch.mm` at 2,048^3 timed right
after it: #46's "60% of the measured bf16 GEMM rate" for a whole prefill. FLOPs counted
(`prefill_flops`): the layers' weight products (2 per weight per token; one row of the
LM head) and attention's QK^T and PV over the pairs a causal mask leaves, nothing for the
norms, RoPE, SiLU or the softmax: what a prefill must compute, not what kiln runs (its
tiles pad each diagonal block, which would count as more).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable


def prompt(n: int, seed: int) -> list[int]:
    """n tokens that no prompt of another seed shares a block with (no prefix hit)."""
    return [1] + [(100 + 7919 * seed + 31 * j) % 40000 + 50 for j in range(n - 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-O", dest="level", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None)
    ab = ap.add_mutually_exclusive_group()
    ab.add_argument("--vs-sdpa", action="store_true")
    ab.add_argument("--vs-all-rows", action="store_true")
    ap.add_argument("--gemm", action="store_true",
                    help="print the FLOP rate and its share of a bf16 torch.mm's")
    args = ap.parse_args()

    from kiln import LLM, SamplingParams
    from kiln.platforms.cpu import CpuPlatform

    longest = max(args.lengths)
    llm = LLM(args.model, dtype=args.dtype, optimization_level=args.level, progress=False,
              max_num_batched_tokens=max(2048, longest), max_model_len=max(4096, longest + 8))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    print(f"prefill TTFT, {llm.engine.dtype}, -O{args.level}, {CpuPlatform().device_name()}")
    variants = _variants(llm, args)
    for n in args.lengths:
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(args.repeats + 1):
            for j, (name, switch) in enumerate(variants.items()):
                switch()
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": prompt(n, 2 * i + j + 10 * n)}, one,
                             use_tqdm=False)
                times[name].append(time.perf_counter() - start)
        best = {name: min(t[1:]) for name, t in times.items()}
        line = "  ".join(f"{name} {b:.3f} s ({n / b:.0f} tok/s)".lstrip()
                         for name, b in best.items())
        ratio = ""
        if len(best) == 2:
            (a, ta), (b, tb) = best.items()
            ratio = f"  {b}/{a} {tb / ta:.2f}x"
        if args.gemm:
            from attention_rows import gemm_tflops  # this directory's (sys.path[0])
            rate = prefill_flops(llm.engine.model_config, n) / min(best.values()) / 1e12
            mm = gemm_tflops()
            ratio += f"  {rate:.2f} TFLOP/s, torch.mm {mm:.2f}: {rate / mm:.0%}"
        print(f"  {n:>6} tokens  {line}{ratio}")
    next(iter(variants.values()))()  # the engine's own setting again


def _variants(llm: Any, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Name -> what switches the engine to it; the first is the engine's default. With
    two, their repeats alternate, so both see the same minutes of a noisy host."""
    import torch

    if args.vs_sdpa:
        kernel = torch.ops.kiln_cpu.set_prefill_kernel
        return {"kernel": lambda: kernel(True), "sdpa": lambda: kernel(False)}
    if args.vs_all_rows:
        kept = llm.engine.runner.kept_rows
        if not kept.enabled:
            raise SystemExit("--vs-all-rows: this engine keeps every row already "
                             "(not the CPU, or not the last pipeline stage)")
        return {"kept": lambda: setattr(kept, "enabled", True),
                "all-rows": lambda: setattr(kept, "enabled", False)}
    return {"": lambda: None}


def prefill_flops(mc, n: int) -> float:
    """The products an n-token prefill of a dense decoder must compute (see --gemm)."""
    from attention_rows import attention_flops  # causal QK^T and PV, n new rows of n

    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    weights = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size \
        + 3 * mc.hidden_size * mc.intermediate_size
    attention = attention_flops(n, n, mc.num_heads, mc.head_dim)
    return mc.num_layers * (2.0 * weights * n + attention) + 2.0 * mc.hidden_size * mc.vocab_size


if __name__ == "__main__":
    main()
