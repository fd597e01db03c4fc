"""The CPU attention op per layer, by context and rows per request:
`python benchmarks/attention_rows.py [--contexts 300 1000] [--rows 1 5 9] [--threads N]
[--gemm]`.

One request (SmolLM2's 9 query / 3 KV heads of 64 by default, bf16, blocks of 16) whose
last `rows` tokens are new: 1 is a decode step, 1 + k a speculative verify step (the
backend runs it as one run of decode rows). Thirty layers' caches, so the KV does not sit
in L1 or L2 between calls as it would not in a model (it may in L3: the engine's weight
stream evicts it there, so time the engine's forward for in-model figures); prints the
best per-layer time of 30 rounds. `--gemm` also prints each case's rate (the products
causal attention needs: 4 D FLOPs per visible query-key pair) and its share of a bf16
`torch.mm` at 2,048 x 2,048 timed after it in the same run: #46's "60% of the GEMM rate".
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from attention_batches import make_batch  # noqa: E402
from kiln.attention.backend import AttentionLayerSpec  # noqa: E402
from kiln.attention.backends.cpu_paged import CpuPagedBackend  # noqa: E402
from kiln.compiler.cache import default_cache_root  # noqa: E402
from kiln.ops import cpu_kernels  # noqa: E402

LAYERS = 30


def per_layer_us(context: int, rows: int, heads: int, kv_heads: int, head_size: int) -> float:
    spec = AttentionLayerSpec(heads, kv_heads, head_size, head_size ** -0.5)
    b = make_batch([(context - rows, rows)], heads, kv_heads, head_size, 16, 0, 0,
                   dtype=torch.bfloat16)
    md = CpuPagedBackend.build_metadata(b.metadata)
    md.activate([md], [b.cache.clone() for _ in range(LAYERS)], [0] * LAYERS,
                [spec] * LAYERS)
    n = b.query.shape[0]
    q = b.query.view(n, heads, head_size)
    k, v = b.key.view(n, kv_heads, head_size), b.value.view(n, kv_heads, head_size)
    out = torch.empty_like(q)
    ids = [torch.tensor(layer) for layer in range(LAYERS)]
    best = float("inf")
    for _ in range(30):
        start = time.perf_counter()
        for layer in ids:
            torch.ops.kiln_cpu.unified_attention(q, k, v, out, layer)
        best = min(best, time.perf_counter() - start)
    md.deactivate()
    return best / LAYERS * 1e6


def attention_flops(context: int, rows: int, heads: int, head_size: int) -> float:
    """QK^T and PV over the pairs a causal mask leaves: row i of `rows` sees
    context - rows + i + 1 keys."""
    pairs = rows * (context - rows) + rows * (rows + 1) / 2
    return 4.0 * head_size * heads * pairs


def gemm_tflops(n: int = 2048, rounds: int = 20) -> float:
    """Best bf16 torch.mm rate at n x n x n (oneDNN's GEMM on this CPU)."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                    metavar=("HEADS", "KV_HEADS", "HEAD_SIZE"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gemm", action="store_true",
                    help="print each rate beside a bf16 torch.mm's, timed after it")
    args = ap.parse_args()
    if not cpu_kernels.ensure_loaded(default_cache_root()):
        sys.exit(f"kiln's CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu attention, bf16, heads {args.heads}, {torch.get_num_threads()} threads, "
          f"ISA class {cpu_kernels.isa_class()}: us per layer")
    heads, _, head_size = args.heads
    for context in args.contexts:
        for rows in args.rows:
            if rows > context:
                print(f"  context {context:5d}  rows {rows:4d}  skipped: more rows than context")
                continue
            us = per_layer_us(context, rows, *args.heads)
            line = f"  context {context:5d}  rows {rows:4d}  {us:8.1f} us"
            if args.gemm:
                rate = attention_flops(context, rows, heads, head_size) / us / 1e6
                mm = gemm_tflops()
                line += (f"  {rate:5.2f} TFLOP/s  torch.mm {mm:5.2f} TFLOP/s  "
                         f"share {rate / mm:4.0%}")
            print(line)


if __name__ == "__main__":
    main()
