"""`kiln bench serve`: load a running OpenAI-compatible server on this machine.

Requests arrive as a Poisson process at `request_rate` per second (`None`: all at once),
at most `max_concurrency` in flight (`None`: unlimited); each streams its completion
(`POST /v1/completions`, stream=True, EOS ignored) and is timed per chunk.

JSON (`--json`), units in the field names:
    mode "serve", environment, config {url, model, num_prompts, input_len, output_len,
    random_range_ratio, request_rate (req/s, null = all at once), max_concurrency
    (null = unlimited), prompt_type, seed}, completed, failed, errors (first 5),
    duration_s (first send to last response), total_input_tokens, total_output_tokens,
    request_throughput_req_s, output_tok_s, total_tok_s,
    ttft_ms (time to first token), tpot_ms (time per output token after the first),
    itl_ms (every gap between tokens), e2e_ms (request latency): {n, mean, min, p50, p90,
    p99, max}, samples {ttft_ms, tpot_ms, itl_ms, e2e_ms}.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from kiln.bench import plots
from kiln.bench.report import SUMMARY_HEADERS, environment, summary_rows, table
from kiln.bench.serve_client import RequestResult, check_local_url, send_completion
from kiln.bench.stats import scaled, summarize
from kiln.bench.workload import check_positive, lengths, random_prompts

# Plain words that most tokenizers encode as one token each (with their leading space):
# a text prompt of n words is close to n tokens.
_WORDS = ("the of and to in is was for on that with as by at from his her an were are "
          "which this be or had not but one all their there when who will more no if out "
          "so said what up its about into than them can only other new some could time "
          "these two may then do first any my now such like our over man me even most "
          "made after also did many before must through back years where much your way "
          "well down should because each just those people how too little state good very "
          "make world still own see men work long get here between both life being under "
          "never day same another know while last might us great old year off come since "
          "against go came right used take three").split()


def build_prompts(n: int, input_len: int, range_ratio: float, prompt_type: str,
                  rng: random.Random) -> list[tuple[str | list[int], int]]:
    """(prompt, requested length) pairs: words for 'text', random ids for 'ids' (a model
    without a tokenizer needs ids)."""
    lens = lengths(n, input_len, range_ratio, rng, "input_len")
    if prompt_type == "text":
        return [(" ".join(rng.choice(_WORDS) for _ in range(k)), k) for k in lens]
    if prompt_type == "ids":
        # 256 is a vocabulary every model has; the server never needs to decode the prompt.
        return list(zip(random_prompts(lens, 256, rng), lens))
    raise ValueError(f"prompt_type={prompt_type!r} must be 'text' or 'ids'")


def run_serve(url: str, num_prompts: int, input_len: int, output_len: int, *,
              model: str | None = None, request_rate: float | None = None,
              max_concurrency: int | None = None, random_range_ratio: float = 0.0,
              prompt_type: str = "text", seed: int = 0,
              request_timeout_s: float = 600.0) -> dict[str, Any]:
    base = check_local_url(url)
    check_positive(num_prompts=num_prompts, output_len=output_len)
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} must be positive (omit it for "
                         "all requests at once)")
    if max_concurrency is not None:
        check_positive(max_concurrency=max_concurrency)
    try:
        import httpx
    except ImportError:
        raise ValueError("kiln bench serve needs httpx: pip install 'kiln-llm[bench]'") \
            from None
    rng = random.Random(seed)
    prompts = build_prompts(num_prompts, input_len, random_range_ratio, prompt_type, rng)
    out_lens = lengths(num_prompts, output_len, random_range_ratio, rng, "output_len")
    results, duration, model = asyncio.run(_drive(
        httpx, base, model, prompts, out_lens, request_rate, max_concurrency, rng,
        request_timeout_s))
    config = {"url": base, "model": model, "num_prompts": num_prompts,
              "input_len": input_len, "output_len": output_len,
              "random_range_ratio": random_range_ratio, "request_rate": request_rate,
              "max_concurrency": max_concurrency, "prompt_type": prompt_type, "seed": seed}
    return _aggregate(results, duration, config)


async def _drive(httpx: Any, base: str, model: str | None,
                 prompts: list[tuple[str | list[int], int]], out_lens: list[int],
                 rate: float | None, concurrency: int | None, rng: random.Random,
                 timeout_s: float) -> tuple[list[RequestResult], float, str]:
    limits = httpx.Limits(max_connections=concurrency or len(prompts) or 1)
    # No proxies from the environment and no redirects: traffic stays on the checked URL.
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 trust_env=False, follow_redirects=False) as client:
        model = model or await _served_model(client, base)
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def one(prompt: str | list[int], plen: int, n: int) -> RequestResult:
            payload = {"model": model, "prompt": prompt, "max_tokens": n, "stream": True,
                       "temperature": 0.0, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}
            if gate is None:
                return await send_completion(client, f"{base}/v1/completions", payload, plen)
            async with gate:
                return await send_completion(client, f"{base}/v1/completions", payload, plen)

        start = time.perf_counter()
        tasks = []
        for i, ((prompt, plen), n) in enumerate(zip(prompts, out_lens)):
            if rate is not None and i > 0:
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(one(prompt, plen, n)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


async def _served_model(client: Any, base: str) -> str:
    try:
        resp = await client.get(f"{base}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as exc:
        raise ValueError(f"cannot list models at {base}/v1/models ({type(exc).__name__}: "
                         f"{exc}); is `kiln serve` running there? Pass --served-model-name "
                         "to skip this lookup") from None


def _aggregate(results: list[RequestResult], duration: float,
               config: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = scaled([r.ttft for r in ok], 1e3)
    tpot = scaled([t for r in ok if (t := r.tpot) is not None], 1e3)
    itl = scaled([gap for r in ok for gap in r.itl], 1e3)
    e2e = scaled([r.e2e for r in ok], 1e3)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return {
        "mode": "serve", **environment(), "config": config,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "duration_s": duration, "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput_req_s": len(ok) / duration if duration else None,
        "output_tok_s": total_out / duration if duration else None,
        "total_tok_s": (total_in + total_out) / duration if duration else None,
        "ttft_ms": summarize(ttft), "tpot_ms": summarize(tpot), "itl_ms": summarize(itl),
        "e2e_ms": summarize(e2e),
        "samples": {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl, "e2e_ms": e2e},
    }


def format_serve(r: dict[str, Any]) -> str:
    c = r["config"]
    rate = "inf" if c["request_rate"] is None else f"{c['request_rate']:g}"
    head = (f"serve: {c['url']} model {c['model']}, {c['num_prompts']} requests, input "
            f"{c['input_len']}, output {c['output_len']}, rate {rate} req/s, max concurrency "
            f"{c['max_concurrency'] or 'unlimited'}")
    body = table(SUMMARY_HEADERS, summary_rows({
        "TTFT (ms)": r["ttft_ms"], "TPOT (ms)": r["tpot_ms"], "ITL (ms)": r["itl_ms"],
        "E2E (ms)": r["e2e_ms"]}))
    tail = (f"{r['completed']} ok, {r['failed']} failed in {r['duration_s']:.2f} s | "
            f"{r['request_throughput_req_s'] or 0:.2f} req/s | output "
            f"{r['output_tok_s'] or 0:.1f} tok/s | total {r['total_tok_s'] or 0:.1f} tok/s")
    errors = [f"error: {e}" for e in r["errors"]]
    return "\n".join([head, body, tail, *errors])


def plot_serve(r: dict[str, Any], out_dir: Path) -> list[Path]:
    s = r["samples"]
    return [plots.distributions({"TTFT (ms)": s["ttft_ms"], "TPOT (ms)": s["tpot_ms"],
                                 "ITL (ms)": s["itl_ms"], "E2E (ms)": s["e2e_ms"]},
                                f"kiln bench serve, {r['completed']} requests",
                                out_dir / "serve.png")]
