"""The linears of one whole decode step, as the engine meets them: every layer's weights
distinct (so they stream from DRAM, not cache), kiln's CPU kernels per weight format.

    .venv/bin/python benchmarks/quant_step.py [--rows 1 2 4 8] [--layers 30]
        [--formats bf16 q4 q8 int8] [--panel-from N] [--no-huge-pages]

Shapes are SmolLM2-135M's (fused qkv, o, fused gate|up, down). Prints ms per step, the
weight bytes read per second, and each format's speed-up over bf16. Per-shape kernel
choices (`kiln bench kernels --ops linear_quant`) time one weight that stays in cache;
this is the honest measure of a decode step's linear time. `--panel-from` forces the
quantized layers' panel row count (0: always direct, 1: always panel); by default each
layer's panel row count as the engine sets it without table entries
(`plan.layer_panel_from`). The weights sit on transparent huge pages where the host
grants them, as the engine's do (`kiln.runner.huge_pages`); `--no-huge-pages` keeps
them in malloc'd memory (4 KiB pages: Q4, 30 layers, 1 row, Zen 4 read 4.2 vs 3.45 ms).
"""
from __future__ import annotations

import argparse
import time

import torch

from kiln.compiler.cache import default_cache_root
from kiln.ops import cpu_kernels
from kiln.ops.linear import linear, linear_quant, pack
from kiln.ops.quant_packing import pack_q4, pack_q8, quantize_int8
from kiln.quantization.plan import layer_panel_from
from kiln.runner.huge_pages import move_weights_to_huge_pages

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def weights(fmt: str, layers: int, g: torch.Generator) -> list:
    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g) * 0.05
            if fmt == "bf16":
                out.append(pack(w.to(torch.bfloat16)))
            elif fmt == "q4":
                out.append(pack_q4(torch.randint(0, 16, (n, k), generator=g),
                                   torch.rand(n, k // 32, generator=g) * 0.01,
                                   -torch.rand(n, k // 32, generator=g) * 0.08))
            elif fmt == "q8":
                out.append(pack_q8(torch.randint(-127, 128, (n, k), generator=g),
                                   torch.rand(n, k // 32, generator=g) * 0.001))
            else:
                out.append(quantize_int8(w))
    return out


def to_huge_pages(ws: list) -> None:
    """Move the weights' tensors onto huge pages in place, as the runner moves a model's."""
    holder = torch.nn.Module()
    tensors = [t for w in ws for t in ((w,) if isinstance(w, torch.Tensor)
                                       else (w.codes, w.scales, w.mins)) if t is not None]
    for i, t in enumerate(tensors):
        holder.register_buffer(f"t{i}", t)
    move_weights_to_huge_pages(holder)


def nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes()


def step(fmt: str, ws: list, xs: dict, panel_from: int | None = None) -> None:
    for w in ws:
        x = xs[_k(w)]
        if fmt == "bf16":
            linear(x, None, None, w)
        else:
            # by default the engine's: the panel kernel from this ISA's row count on
            p = layer_panel_from(w.fmt, None) if panel_from is None else panel_from
            linear_quant(x, w.codes, w.scales, w.mins, None, w.fmt, p)


def _k(w) -> int:
    """K of a packed bf16 weight ([N/16, K/32, 16, 32]) or a QuantWeight."""
    return w.shape[1] * 32 if isinstance(w, torch.Tensor) else w.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--formats", nargs="+", default=["bf16", "q4", "q8", "int8"],
                    choices=["bf16", "q4", "q8", "int8"])
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--panel-from", type=int, default=None)
    ap.add_argument("--no-huge-pages", action="store_true")
    args = ap.parse_args()
    if not cpu_kernels.ensure_loaded(default_cache_root()):
        raise SystemExit(f"kiln's CPU kernels are unavailable: "
                         f"{cpu_kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    sets = {f: weights(f, args.layers, g) for f in args.formats}
    if not args.no_huge_pages:
        for ws in sets.values():
            to_huge_pages(ws)
    print(f"ISA class {cpu_kernels.isa_class()}, {torch.get_num_threads()} threads, "
          f"{args.layers} layers, min of {args.samples} interleaved samples")
    print(f"{'rows':>4} " + " ".join(f"{f + ' ms':>9} {'GB/s':>6}" for f in args.formats)
          + "  speed-up over " + args.formats[0])
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16)
              for k in {k for _, k in SHAPES}}
        best = {f: float("inf") for f in args.formats}
        for f in args.formats:
            step(f, sets[f], xs, args.panel_from)  # warm-up
        for _ in range(args.samples):
            for f in args.formats:  # interleaved, so drift hits every format alike
                start = time.perf_counter()
                step(f, sets[f], xs, args.panel_from)
                best[f] = min(best[f], time.perf_counter() - start)
        gbs = {f: sum(nbytes(w) for w in sets[f]) / best[f] / 1e9 for f in args.formats}
        base = best[args.formats[0]]
        print(f"{rows:>4} " + " ".join(f"{best[f] * 1e3:>9.2f} {gbs[f]:>6.1f}"
                                       for f in args.formats)
              + "  " + " ".join(f"{base / best[f]:.2f}x" for f in args.formats), flush=True)


if __name__ == "__main__":
    main()
