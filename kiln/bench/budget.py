"""`kiln bench budget`: the chunked-prefill token budget (max_num_batched_tokens) for this
model on this host, chosen by measurement, written to the tuning table.

A small budget cuts a long prompt into many steps: the requests decoding beside it get a
token every short step (smooth), but each step pays its fixed cost (weights read, Python,
the graph call) for fewer prompt tokens. A large budget runs the prompt at full speed and
stalls the decode rows for a long step. For each candidate budget one engine runs
`--decode-rows` requests decoding while a `--prompt-len` prompt arrives, and the bench
times every step until that prompt's first token. The chosen budget is the smallest one
whose prefill rate is at least `--threshold` (0.9) of the best candidate's: full speed,
and the shortest steps for the rows decoding beside it.

The engine reads the table at start-up when max_num_batched_tokens is not given (`LLM`,
every `kiln` command); the key is the model's name, the requested dtype and quantization
(`kiln.ops.tuning.budget_key`), under this device's name.

JSON (`--json`): mode "budget", environment, config {candidates, prompt_len, decode_rows,
threshold, repeats, model, dtype, quantization, optimization_level}, runs {budget: {
prefill_s, prefill_tok_s, steps, step_ms {n, mean, min, p50, p90, p99, max}}}, best,
key, tuning_file (where it was written; null with --no-write).
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable

from kiln.bench.report import environment, table
from kiln.bench.stats import scaled, summarize
from kiln.bench.workload import check_positive, random_prompts


def run_budget(make: Callable[[int], Any], candidates: list[int], prompt_len: int,
               decode_rows: int, threshold: float = 0.9, repeats: int = 2,
               seed: int = 0) -> dict[str, Any]:
    """`make(budget)` builds an engine (an `LLM`) with that max_num_batched_tokens."""
    check_positive(prompt_len=prompt_len, decode_rows=decode_rows, repeats=repeats)
    if not candidates or any(c < 1 for c in candidates):
        raise ValueError(f"candidates={candidates}: give positive token budgets")
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold={threshold} must be in (0, 1]")
    runs: dict[int, dict[str, Any]] = {}
    rng = random.Random(seed)
    config: dict[str, Any] = {}
    for budget in sorted(set(candidates)):
        llm = make(budget)
        try:
            config = _engine_settings(llm.engine)
            took = [_one_run(llm.engine, prompt_len, decode_rows, rng, f"b{budget}r{i}")
                    for i in range(repeats + 1)]
            prefill_s, steps = min(took[1:])  # the first run warms up, unkept
            runs[budget] = {"prefill_s": prefill_s, "prefill_tok_s": prompt_len / prefill_s,
                            "steps": len(steps), "step_ms": summarize(scaled(steps, 1e3))}
        finally:
            llm.shutdown()
    top = max(r["prefill_tok_s"] for r in runs.values())
    chosen = min(b for b, r in runs.items() if r["prefill_tok_s"] >= threshold * top)
    return {"mode": "budget", **environment(config.get("device", "cpu")),
            "config": {"candidates": sorted(set(candidates)), "prompt_len": prompt_len,
                       "decode_rows": decode_rows, "threshold": threshold,
                       "repeats": repeats, **config},
            "runs": {str(b): r for b, r in runs.items()}, "best": chosen}


def _engine_settings(engine: Any) -> dict[str, Any]:
    c = engine.config
    return {"model": c.model, "dtype": c.dtype, "quantization": c.quantization,
            "optimization_level": c.optimization_level, "device": c.device}


def _one_run(engine: Any, prompt_len: int, decode_rows: int, rng: random.Random,
             tag: str) -> tuple[float, list[float]]:
    """(seconds from the long prompt's arrival to its first token, each step's seconds
    meanwhile) with `decode_rows` requests decoding beside it."""
    from kiln.sampling.params import SamplingParams

    vocab = engine.model_config.vocab_size
    if prompt_len + 1 > engine.max_model_len:
        raise ValueError(f"prompt_len={prompt_len} does not fit max_model_len="
                         f"{engine.max_model_len}; shorten it or raise --max-model-len")
    long_decode = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 16,
                                 ignore_eos=True)
    rows = [f"{tag}-d{i}" for i in range(decode_rows)]
    for rid, ids in zip(rows, random_prompts([8] * decode_rows, vocab, rng)):
        engine.add_request(rid, {"prompt_token_ids": ids}, long_decode)
    for _ in range(8):  # every row past its prefill and decoding
        engine.step()
    prompt = random_prompts([prompt_len], vocab, rng)[0]
    engine.add_request(f"{tag}-p", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start, steps = time.perf_counter(), []
    while True:
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t0)
        if any(o.request_id == f"{tag}-p" and o.outputs[0].token_ids for o in outputs):
            break
    took = time.perf_counter() - start
    engine.abort_request(rows)
    while engine.has_unfinished_requests():
        engine.step()
    return took, steps


def format_budget(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"budget: a {c['prompt_len']}-token prompt beside {c['decode_rows']} decoding "
            f"requests, -O{c['optimization_level']} {c['dtype']} ({r['device']})")
    rows = [[b, f"{v['prefill_s']:.3f}", f"{v['prefill_tok_s']:.0f}", v["steps"],
             f"{v['step_ms']['p50']:.1f}", f"{v['step_ms']['max']:.1f}"]
            for b, v in r["runs"].items()]
    body = table(["budget", "prefill s", "prompt tok/s", "steps", "step p50 ms",
                  "step max ms"], rows)
    where = r.get("tuning_file")
    tail = (f"chosen: max_num_batched_tokens={r['best']} (the smallest budget within "
            f"{c['threshold']:.0%} of the best prefill rate)"
            + (f"; written to {where}" if where else "; not written (--no-write)"))
    return "\n".join([head, body, tail])
