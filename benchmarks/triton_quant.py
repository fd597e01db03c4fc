"""The Triton dequant-GEMM on CUDA: every tile config of a small grid timed per format and
row count on SmolLM2-135M's linear shapes, beside cuBLAS's bf16 GEMM of the same shape.

    python3 benchmarks/triton_quant.py [--rows 1 32] [--formats int8 q4 fp8]
        [--decode int8 fp8]     # then decode tokens/s with the best configs installed

Prints, per (format, rows), the best config and its time summed over the shapes of one
layer, with the current default (`kiln.ops.triton_quant.CONFIGS`) and bf16 beside it.
Each candidate's output is checked against the dequantized reference before it is timed.
`--decode` runs benchmarks/compile_levels.py's decode table (-O2, random SmolLM2-shaped
weights) for bf16 and each named method, with the sweep's best config per row count.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kiln.ops import triton_quant
from kiln.ops.quant_packing import dequantize, pack_q4, quantize_fp8, quantize_int8_groups

# SmolLM2-135M: fused qkv, o, fused gate|up, down ([N, K]).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def grid(m: int) -> list[tuple[int, int, int, int]]:
    if m <= 16:  # decode: one row block; the split is over N and the loop over K
        return list(itertools.product((16,), (16, 32, 64), (64, 128), (2, 4)))
    return list(itertools.product((16, 32), (32, 64), (64, 128), (4,)))


def make(fmt: str, n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "int8":
        return quantize_int8_groups(w)
    if fmt == "fp8":
        return quantize_fp8(w)
    return pack_q4(torch.randint(0, 16, (n, k), generator=g),
                   torch.rand(n, k // 32, generator=g) * 0.01,
                   -torch.rand(n, k // 32, generator=g) * 0.08)


def cuda_time(fn, iters: int = 50) -> float:
    """Microseconds per call, replayed from a CUDA graph (as the engine runs decode)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * 10)


def run_with(cfg, x, w, ref, fmt):
    saved = triton_quant.CONFIGS
    triton_quant.CONFIGS = [(1 << 62, cfg)]
    try:
        fn = lambda: triton_quant.linear_quant_cuda(x, *w, None, fmt)  # noqa: E731
        out = fn()
        if not torch.allclose(out.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max()):
            return None
        return cuda_time(fn)
    except Exception:  # an invalid config (shared memory, layout): not a candidate
        return None
    finally:
        triton_quant.CONFIGS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--decode", nargs="*", default=[], help="methods for the decode table")
    ap.add_argument("--formats", nargs="+", default=["int8", "q4", "fp8"])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    chosen: dict[int, dict] = {}
    print(f"{'format':>6} {'rows':>5} {'bf16 us':>8} {'default':>8} {'best':>8}  best config"
          " (BM BN BK warps)")
    for fmt_name, m in itertools.product(args.formats, args.rows):
        weights = [make(fmt_name, n, k, g) for n, k in SHAPES]
        fmt = weights[0].fmt
        cases = []
        for (n, k), w in zip(SHAPES, weights):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            dense = dequantize(w).to(torch.bfloat16).cuda()
            ref = F.linear(x.float(), dense.float())
            dev = [t.cuda() if t is not None else None for t in (w.codes, w.scales, w.mins)]
            cases.append((x, dev, ref, dense))
        bf16 = sum(cuda_time(lambda: F.linear(x, d)) for x, _, _, d in cases)
        default = sum(run_with(triton_quant.config_for(m), x, w, r, fmt) or float("inf")
                      for x, w, r, _ in cases)
        best = (float("inf"), None)
        for cfg in grid(m):
            times = [run_with(cfg, x, w, r, fmt) for x, w, r, _ in cases]
            if None not in times:
                best = min(best, (sum(times), cfg))
        chosen.setdefault(m, {})[fmt_name] = best
        print(f"{fmt_name:>6} {m:>5} {bf16:>8.1f} {default:>8.1f} {best[0]:>8.1f}  {best[1]}",
              flush=True)
    if args.decode:
        decode_table(chosen, args.decode)


def decode_table(chosen: dict, methods: list[str]) -> None:
    """Install the best config per row count (the first format's) and time decode."""
    import tempfile

    from compile_levels import decode_tok_s, random_smollm2

    rows = sorted(chosen)
    bounds = rows[:-1] + [1 << 62]
    triton_quant.CONFIGS = [(b, next(iter(chosen[m].values()))[1]) for b, m in zip(bounds, rows)]
    print(f"\ndecode with CONFIGS = {triton_quant.CONFIGS}")
    ns = argparse.Namespace(model=random_smollm2(tempfile.mkdtemp()), device="cuda",
                            new_tokens=64, batch=[1, 32], random_weights=True)
    cache = tempfile.mkdtemp()
    res = {q: decode_tok_s(ns, 2, cache, q) for q in ["none", *methods]}
    for b in ns.batch:
        print(f"  batch {b:>3}: " + "  ".join(
            f"{q} {r[b]:.0f} tok/s ({r[b] / res['none'][b]:.2f}x)" for q, r in res.items()))


if __name__ == "__main__":
    main()
