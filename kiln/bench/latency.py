"""`kiln bench latency`: one fixed batch, fixed input and output lengths, timed per step.

Each iteration adds `batch_size` fresh random prompts (distinct, so the prefix cache never
hits) and steps the engine until they finish. Steps until every request has its first
token are the prefill; each later step is one decode step of the whole batch.

JSON (`--json`), units in the field names (_s seconds, _ms milliseconds, _tok_s tokens/s):
    mode "latency", environment, config {batch_size, input_len, output_len, num_iters,
    num_iters_warmup, seed, model, dtype, optimization_level}, load_time_s,
    prefill_ms / decode_step_ms / e2e_s: {n, mean, min, p50, p90, p99, max},
    decode_tok_s (batch_size x decode steps / decode time), output_tok_s (generated tokens
    / e2e time), samples {prefill_ms, decode_step_ms, e2e_s}: the raw values.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from kiln.bench import plots
from kiln.bench.report import SUMMARY_HEADERS, engine_facts, environment, summary_rows, table
from kiln.bench.stats import scaled, summarize
from kiln.bench.workload import check_positive, random_prompts


def run_latency(llm: Any, batch_size: int, input_len: int, output_len: int,
                num_iters: int = 5, num_iters_warmup: int = 1, seed: int = 0) -> dict[str, Any]:
    from kiln.sampling.params import SamplingParams

    check_positive(batch_size=batch_size, input_len=input_len, output_len=output_len,
                   num_iters=num_iters)
    if num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup={num_iters_warmup} must be 0 or more")
    engine = llm.engine
    if input_len + output_len > engine.max_model_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds "
                         f"max_model_len={engine.max_model_len}; shorten them or raise "
                         "--max-model-len")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prefill, decode, e2e = [], [], []
    for it in range(num_iters_warmup + num_iters):
        prompts = random_prompts([input_len] * batch_size, vocab, rng)
        p, d, total = _one_iteration(engine, prompts, params, tag=f"lat{it}")
        if it >= num_iters_warmup:  # warm-up iterations are timed but not kept
            prefill.append(p)
            decode.extend(d)
            e2e.append(total)
    decode_time = sum(decode)
    return {
        "mode": "latency", **environment(engine.config.device),
        "config": {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
                   "num_iters": num_iters, "num_iters_warmup": num_iters_warmup, "seed": seed,
                   **engine_facts(engine)},
        "load_time_s": engine.load_time_s,
        "prefill_ms": summarize(scaled(prefill, 1e3)),
        "decode_step_ms": summarize(scaled(decode, 1e3)),
        "e2e_s": summarize(e2e),
        "decode_tok_s": batch_size * len(decode) / decode_time if decode_time else None,
        "output_tok_s": batch_size * output_len * len(e2e) / sum(e2e),
        "samples": {"prefill_ms": scaled(prefill, 1e3), "decode_step_ms": scaled(decode, 1e3),
                    "e2e_s": e2e},
    }


def _one_iteration(engine: Any, prompts: list[list[int]], params: Any,
                   tag: str) -> tuple[float, list[float], float]:
    """(prefill seconds, decode step seconds, end-to-end seconds) for one batch."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    waiting_first = {f"{tag}-{i}" for i in range(len(prompts))}
    start = time.perf_counter()
    prefill_end: float | None = None
    decode: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        if prefill_end is not None:
            decode.append(t1 - t0)
            continue
        waiting_first -= {o.request_id for o in outputs if o.outputs[0].token_ids}
        if not waiting_first:
            prefill_end = t1
    end = time.perf_counter()
    return (prefill_end or end) - start, decode, end - start


def format_latency(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"latency: batch {c['batch_size']}, input {c['input_len']}, output "
            f"{c['output_len']} tokens, {c['num_iters']} iterations, -O"
            f"{c['optimization_level']} {c['dtype']} ({r['device']})")
    body = table(SUMMARY_HEADERS, summary_rows({"prefill (ms)": r["prefill_ms"],
                                                "decode step (ms)": r["decode_step_ms"],
                                                "end-to-end (s)": r["e2e_s"]}), digits=3)
    tail = (f"decode {r['decode_tok_s'] or 0:.1f} tok/s | output {r['output_tok_s']:.1f} "
            f"tok/s | load {r['load_time_s']:.1f} s")
    return "\n".join([head, body, tail])


def plot_latency(r: dict[str, Any], out_dir: Path) -> list[Path]:
    s = r["samples"]
    return [plots.distributions({"prefill (ms)": s["prefill_ms"],
                                 "decode step (ms)": s["decode_step_ms"]},
                                f"kiln bench latency, batch {r['config']['batch_size']}",
                                out_dir / "latency.png")]
