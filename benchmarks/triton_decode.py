"""Decode attention micro-benchmark: the Triton backend replayed from a CUDA graph against
the torch backend run eagerly, per layer call; `--sweep` times every launch config.

    .venv/bin/python benchmarks/triton_decode.py                 # CUDA
    .venv/bin/python benchmarks/triton_decode.py --sweep --batch 32 --context 2048
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/triton_decode.py --device cpu --batch 2 \
        --context 64 --iters 1                                   # smoke test only
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from kiln.attention.backend import AttentionLayerSpec, AttentionMetadata
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend


def decode_batch(batch: int, context: int, spec: AttentionLayerSpec, block_size: int,
                 dtype: torch.dtype, device: str):
    """`batch` single-token decodes, each over `context` cached tokens, scattered blocks."""
    per_seq = -(-(context + 1) // block_size)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, spec.num_kv_heads, spec.head_size,
                        dtype=dtype, device=device)
    table = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, per_seq)
    table = table.to(torch.int32)
    lens = [context + 1] * batch
    qsl = list(range(batch + 1))
    slots = table[:, context // block_size].long() * block_size + context % block_size
    md = AttentionMetadata(
        num_actual_tokens=batch, num_reqs=batch,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table,
        slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=1,
        max_seq_len=context + 1, block_size=block_size)
    q = torch.randn(batch, spec.num_heads * spec.head_size, dtype=dtype, device=device)
    kv = torch.randn(batch, spec.num_kv_heads * spec.head_size, dtype=dtype, device=device)
    return q, kv, cache, md


def time_call(fn: Callable[[], None], iters: int, device: str) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def layer_call(cls, spec, q, kv, cache, md, graph: bool) -> Callable[[], None]:
    backend, out = cls(spec), torch.empty_like(q)
    md = cls.build_metadata(md)

    def call() -> None:
        backend.forward(q, kv, kv, cache, md, out)

    if not graph:
        return call
    call()  # JIT outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return g.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="time every UnifiedAttentionConfig")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = AttentionLayerSpec(args.heads, args.kv_heads, args.head_size, args.head_size ** -0.5)
    graph = args.device == "cuda"
    kv_bytes = 2 * args.kv_heads * args.head_size * dtype.itemsize
    print(f"{'batch':>6} {'context':>8} {'triton us':>10} {'GB/s':>7} {'torch us':>9}")
    for batch in args.batch:
        for context in args.context:
            inputs = decode_batch(batch, context, spec, args.block_size, dtype, args.device)
            t = time_call(layer_call(TritonPagedBackend, spec, *inputs, graph=graph),
                          args.iters, args.device)
            ref = time_call(layer_call(TorchPagedBackend, spec, *inputs, graph=False),
                            args.iters, args.device)
            gbs = batch * (context + 1) * kv_bytes / t / 1e9
            print(f"{batch:>6} {context:>8} {t * 1e6:>10.1f} {gbs:>7.1f} {ref * 1e6:>9.1f}")
            if args.sweep:
                sweep(spec, inputs, args, graph)


def sweep(spec, inputs, args, graph: bool) -> None:
    from kiln.attention.kernels.attention_kernel import sweep_space

    results = []
    for cfg in sweep_space(spec.num_heads // spec.num_kv_heads):
        TritonPagedBackend.kernel_config = cfg
        try:
            t = time_call(layer_call(TritonPagedBackend, spec, *inputs, graph=graph),
                          args.iters, args.device)
        except Exception as exc:  # out of shared memory / registers: not a candidate
            print(f"    {cfg}: {type(exc).__name__}")
            continue
        finally:
            TritonPagedBackend.kernel_config = None
        results.append((t, cfg))
    for t, cfg in sorted(results, key=lambda r: r[0])[:5]:
        print(f"    {t * 1e6:8.1f} us  {cfg}")


if __name__ == "__main__":
    main()
