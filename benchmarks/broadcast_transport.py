"""The `mp` executor's per-step control path, two transports side by side:

    python benchmarks/broadcast_transport.py [--workers 2] [--steps 300] [--requests 32]

Each step the engine sends a decode step's worth of scheduler output (pickled: request
ids, one token and a block id each) to every worker, and rank 0 answers with one token
per request. (a) torch.distributed: the engine is the last rank of a gloo world,
`broadcast_object_list` out, `send/recv_object_list` back (what kiln uses); (b) one
multiprocessing pipe per worker. The workers do no model work, so this is the transport
alone; blocks of steps alternate between the two. Prints microseconds per step.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import pickle
import socket
import time

import torch.distributed as dist


def _payload(requests: int, step: int) -> dict:
    return {"step": step, "reqs": {f"req-{i}": {"tokens": [step], "blocks": [i, step]}
                                   for i in range(requests)}}


def _worker(rank: int, world: int, port: int, conn) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    engine = world - 1
    while True:
        mode = conn.recv()
        if mode == "stop":
            break
        n = conn.recv()
        for _ in range(n):
            if mode == "gloo":
                box = [None]
                dist.broadcast_object_list(box, src=engine)
                msg = box[0]
                if rank == 0:
                    dist.send_object_list([list(msg["reqs"])], dst=engine)
            else:
                msg = pickle.loads(conn.recv_bytes())
                if rank == 0:
                    conn.send_bytes(pickle.dumps(list(msg["reqs"])))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(args.workers)]
    world = args.workers + 1
    procs = [ctx.Process(target=_worker, args=(r, world, port, pipes[r][1]))
             for r in range(args.workers)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=args.workers, world_size=world)
    totals = {"gloo": 0.0, "pipe": 0.0}
    block = 50
    for b in range(2 * args.steps // block):
        mode = ("gloo", "pipe")[b % 2]
        for a, _ in pipes:
            a.send(mode)
            a.send(block)
        start = time.perf_counter()
        for step in range(block):
            msg = _payload(args.requests, step)
            if mode == "gloo":
                dist.broadcast_object_list([msg], src=args.workers)
                dist.recv_object_list([None], src=0)
            else:
                data = pickle.dumps(msg)
                for a, _ in pipes:
                    a.send_bytes(data)
                pickle.loads(pipes[0][0].recv_bytes())
        totals[mode] += time.perf_counter() - start
    for a, _ in pipes:
        a.send("stop")
    for p in procs:
        p.join()
    dist.destroy_process_group()
    size = len(pickle.dumps(_payload(args.requests, 0)))
    print(f"{args.workers} workers, {args.requests} requests per step ({size} B pickled), "
          f"{args.steps} steps each")
    for mode, total in totals.items():
        print(f"  {mode:5s} {1e6 * total / args.steps:8.0f} us/step")
    print(f"  gloo / pipe = {totals['gloo'] / totals['pipe']:.2f}")


if __name__ == "__main__":
    main()
