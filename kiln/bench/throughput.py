"""`kiln bench throughput`: N offline requests submitted at once, run to completion.

Input and output lengths are fixed (`random_range_ratio` 0) or drawn uniformly around
the given means. EOS is ignored so each request generates exactly its output length and
the work is the same on every run.

JSON (`--json`), units in the field names:
    mode "throughput", environment, config {num_prompts, input_len, output_len,
    random_range_ratio, seed, model, dtype, optimization_level, attention_backend},
    load_time_s, elapsed_s, num_requests, total_input_tokens, total_output_tokens,
    requests_per_s, output_tok_s, total_tok_s ((input + output) / elapsed),
    ttft_s / latency_s {n, mean, min, p50, p90, p99, max}: per request, from submission
    (all at t=0) to its first token / to its last token, samples {ttft_s, latency_s}.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from kiln.bench import plots
from kiln.bench.report import SUMMARY_HEADERS, engine_facts, environment, summary_rows, table
from kiln.bench.stats import summarize
from kiln.bench.workload import check_positive, lengths, random_prompts


def run_throughput(llm: Any, num_prompts: int, input_len: int, output_len: int,
                   random_range_ratio: float = 0.0, seed: int = 0,
                   lora_requests: list[Any] | None = None,
                   temperature: float = 0.0) -> dict[str, Any]:
    """`lora_requests`: adapters given to the requests in turn (None: the base model).
    `temperature` > 0 samples every token (vLLM's throughput benchmark samples at 1.0),
    which times the sampler's draw as well."""
    from kiln.sampling.params import SamplingParams

    check_positive(num_prompts=num_prompts)
    engine = llm.engine
    rng = random.Random(seed)
    in_lens = lengths(num_prompts, input_len, random_range_ratio, rng, "input_len")
    out_lens = lengths(num_prompts, output_len, random_range_ratio, rng, "output_len")
    longest = max(i + o for i, o in zip(in_lens, out_lens))
    if longest > engine.max_model_len:
        raise ValueError(f"the longest request needs {longest} tokens but max_model_len is "
                         f"{engine.max_model_len}; lower input_len/output_len or "
                         "random_range_ratio, or raise --max-model-len")
    prompts = random_prompts(in_lens, engine.model_config.vocab_size, rng)
    ids = [f"tp-{i}" for i in range(num_prompts)]
    start = time.perf_counter()
    loras = lora_requests or [None]
    for i, (rid, p, n) in enumerate(zip(ids, prompts, out_lens)):
        engine.add_request(rid, {"prompt_token_ids": p},
                           SamplingParams(temperature=temperature, max_tokens=n,
                                          ignore_eos=True),
                           lora_request=loras[i % len(loras)])
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        for o in outputs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
                generated += len(o.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    ttft = [first[r] for r in ids if r in first]
    latency = [done[r] for r in ids if r in done]
    total_in = sum(in_lens)
    return {
        "mode": "throughput", **environment(engine.config.device),
        "config": {"num_prompts": num_prompts, "input_len": input_len,
                   "output_len": output_len, "random_range_ratio": random_range_ratio,
                   "seed": seed, "temperature": temperature, **engine_facts(engine)},
        "load_time_s": engine.load_time_s, "elapsed_s": elapsed,
        "num_requests": len(done), "total_input_tokens": total_in,
        "total_output_tokens": generated, "requests_per_s": len(done) / elapsed,
        "output_tok_s": generated / elapsed, "total_tok_s": (total_in + generated) / elapsed,
        "ttft_s": summarize(ttft), "latency_s": summarize(latency),
        "samples": {"ttft_s": ttft, "latency_s": latency},
    }


def format_throughput(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"throughput: {c['num_prompts']} requests, input {c['input_len']}, output "
            f"{c['output_len']} tokens (range ratio {c['random_range_ratio']}, temperature "
            f"{c['temperature']}), -O"
            f"{c['optimization_level']} {c['dtype']} ({r['device']})")
    body = table(SUMMARY_HEADERS, summary_rows({"time to first token (s)": r["ttft_s"],
                                                "request latency (s)": r["latency_s"]}),
                 digits=3)
    tail = (f"{r['num_requests']} requests in {r['elapsed_s']:.2f} s | "
            f"{r['requests_per_s']:.2f} req/s | output {r['output_tok_s']:.1f} tok/s | "
            f"total {r['total_tok_s']:.1f} tok/s")
    return "\n".join([head, body, tail])


def plot_throughput(r: dict[str, Any], out_dir: Path) -> list[Path]:
    s = r["samples"]
    return [plots.distributions({"time to first token (s)": s["ttft_s"],
                                 "request latency (s)": s["latency_s"]},
                                f"kiln bench throughput, {r['num_requests']} requests",
                                out_dir / "throughput.png")]
