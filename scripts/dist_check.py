"""Sanity check for tensor parallelism: do collectives work here, and through kiln?

    python scripts/dist_check.py [--nproc 2] [--device cpu|cuda]

Without torchrun's environment it relaunches itself under torchrun with --nproc ranks;
under torchrun (`torchrun --nnodes 2 --nproc-per-node 8 ... scripts/dist_check.py`) it
runs as one rank. Layered like vLLM's troubleshooting script, so the first failure says
where to look:
  1. gloo all_reduce on the CPU (fails: gloo setup, network interfaces, MASTER_ADDR);
  2. the device backend's all_reduce (NCCL on CUDA: driver, NCCL, /dev/shm);
  3. broadcast of a Python object over the CPU group (the executor's control path);
  4. kiln's collective custom ops, eager and inside torch.compile (the compiled path);
  5. on CUDA, an all_reduce captured in a CUDA graph, correct after replay;
then it times one decode-sized all-reduce (what each row-parallel layer pays per step).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _launch(nproc: int, device: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           __file__, "--device", device]
    return subprocess.call(cmd)


def _check(name: str, ok: bool, rank: int) -> bool:
    if rank == 0:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return _launch(args.nproc, args.device)
    import torch
    import torch.distributed as dist

    from kiln.distributed.collectives import tp_all_gather, tp_all_reduce
    from kiln.distributed.parallel_state import (device_backend, get_tp_group,
                                                 init_distributed, initialize_model_parallel)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    init_distributed(world, rank)
    initialize_model_parallel(world, device, world)
    if rank == 0:
        nccl = (".".join(map(str, torch.cuda.nccl.version()))
                if device.type == "cuda" else "-")
        print(f"kiln dist_check: torch {torch.__version__}, {world} ranks, device "
              f"{device}, backend {device_backend(device)} (nccl {nccl}), gloo "
              f"{dist.is_gloo_available()}", flush=True)
    results = []
    t = torch.ones(4)
    dist.all_reduce(t)
    results.append(_check("gloo all_reduce (CPU)", bool((t == world).all()), rank))
    tp = get_tp_group()
    d = torch.full((4,), float(rank + 1), device=device)
    d = tp.all_reduce(d)
    expect = world * (world + 1) / 2
    results.append(_check(f"{device_backend(device)} all_reduce ({device.type})",
                          bool((d == expect).all()), rank))
    box = [{"step": 7, "from": rank}]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    results.append(_check("broadcast_object_list (CPU group)", box[0]["from"] == 0, rank))
    x = torch.full((3, 2), float(rank), device=device)
    gathered = tp_all_gather(x, -1)
    ok = gathered.shape == (3, 2 * world) and bool((gathered[:, -1] == world - 1).all())
    results.append(_check("kiln::all_gather (eager)", ok, rank))
    compiled = torch.compile(lambda v: tp_all_reduce(v * 2) + 1, fullgraph=True)
    y = compiled(torch.ones(5, device=device))
    results.append(_check("kiln::all_reduce inside torch.compile (one graph)",
                          bool((y == 2 * world + 1).all()), rank))
    if device.type == "cuda":
        results.append(_check("all_reduce in a CUDA graph, after replay",
                              _cuda_graph_all_reduce(tp, world), rank))
    _time_all_reduce(tp, device, rank)
    tp.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("all passed" if all(results) else "FAILED", flush=True)
    return 0 if all(results) else 1


def _time_all_reduce(tp, device, rank: int, calls: int = 200) -> None:
    """Latency of one small all-reduce (a decode step's hidden row) on the device group:
    what every row-parallel layer pays per step."""
    import time

    import torch

    x = torch.ones(1, 576, device=device)
    for _ in range(20):
        tp.all_reduce(x)
    tp.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        tp.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if rank == 0:
        print(f"  info  all_reduce of [1, 576] fp32: "
              f"{1e6 * (time.perf_counter() - start) / calls:.0f} us per call", flush=True)


def _cuda_graph_all_reduce(tp, world: int) -> bool:
    import torch

    static = torch.ones(8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tp.all_reduce(static)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(static)
    static.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    return bool((out == 2.0 * world).all())


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
