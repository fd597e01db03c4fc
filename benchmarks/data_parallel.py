"""Data-parallel serving side by side: `kiln serve -dp N` for each N, the same requests.

    python benchmarks/data_parallel.py [--dp 1 2] [--requests 32] [--new-tokens 64]
        [--rounds 2] [--serve-args "--model DIR -O2"]

For each N: a fresh `kiln serve -dp N` (N = 1 is the plain server: one engine with every
CPU thread; N > 1 gives each replica cpus // N threads and its own CPUs), one warm-up
request per replica, then `--rounds` rounds of `--requests` concurrent greedy completions
of exactly `--new-tokens` tokens each (ignore_eos) from the `openai` client; the best
round's wall time and output tok/s are printed, with the ratio to the first N. Each
server is stopped before the next starts, so the sizes never share the CPUs.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import tempfile
import time
from pathlib import Path

import openai

from kiln.bench.server_proc import ServerProcess


async def _round(url: str, model: str, requests: int, new_tokens: int) -> tuple[float, int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)

    async def one(i: int) -> int:
        r = await client.completions.create(
            model=model, prompt=f"Request {i}: write about the number {i}.",
            max_tokens=new_tokens, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - start
    await client.close()
    return wall, sum(tokens)


def run(dp: int, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    argv = [*shlex.split(args.serve_args), "-dp", str(dp)]
    server = ServerProcess(argv, log_dir / f"dp{dp}.log")
    try:
        start = time.perf_counter()
        server.wait_ready(1800)
        ready = time.perf_counter() - start
        model = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list() \
            .data[0].id
        # Sequential: every replica is idle at each pick, so ties rotate over all of them.
        for i in range(dp):
            asyncio.run(_round(server.url, model, 1, 4))
        best = min((asyncio.run(_round(server.url, model, args.requests, args.new_tokens))
                    for _ in range(args.rounds)), key=lambda r: r[0])
    finally:
        server.stop()
    wall, tokens = best
    return {"dp": dp, "ready_s": ready, "wall_s": wall, "tokens": tokens,
            "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-args", default="",
                    help="kiln serve flags for every size (default: the embedded model, -O2)")
    args = ap.parse_args()

    from kiln.platforms import device_name

    print(f"device: {device_name()}; kiln serve {args.serve_args or '(defaults)'}; "
          f"{args.requests} concurrent requests x {args.new_tokens} new tokens, best of "
          f"{args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(dp, args, Path(tmp)) for dp in args.dp]
    base = rows[0]["tok_s"]
    print(f"{'dp':>3} {'ready s':>8} {'wall s':>8} {'tokens':>7} {'tok/s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['dp']:>3} {r['ready_s']:>8.1f} {r['wall_s']:>8.2f} {r['tokens']:>7} "
              f"{r['tok_s']:>8.1f} {r['tok_s'] / base:>5.2f}x")


if __name__ == "__main__":
    main()
