"""`kiln bench spec`: speculative decoding vs none at batch 1, side by side.

Two engines of the same model in one process: `base` (no speculation) and `spec` (the
`--speculative-config`, by default DEFAULT_SPEC: n-gram lookup, k = 6, lookup 2..5).
Two workloads, each prompt run alone (batch 1) and greedy:
  grounded  repeat or lightly edit a given text or code (the output copies its input:
            what prompt lookup is for); the texts are public domain or written here
  chat      free-form questions (the output rarely repeats: speculation should cost
            little there)
The cases are interleaved `--repeats` times after one warm-up round, alternating which
engine goes first. Throughput is output tokens over the requests' wall time (prefill
included, the same for both). `speedup` is spec over base per workload: the median over
repeats of each repeat's ratio (the two engines run back to back, so the host's drift
cancels), with its range. Acceptance statistics are those of the spec engine's steps in
that workload. Greedy outputs must be identical (`identical`).
JSON: mode "spec", environment, config, runs {workload: {case: [tok/s per repeat]}},
median_tok_s, speedup, speedup_range {workload: [min, max]}, acceptance {workload:
SpecDecodingStats.as_dict()}, identical.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

from kiln.bench.report import engine_facts, environment, table

_TEXT = (Path(__file__).parent / "data" / "declaration.txt").read_text().split("\n\n")
_CODE = '''def merge_sort(items):
    if len(items) <= 1:
        return items
    mid = len(items) // 2
    left = merge_sort(items[:mid])
    right = merge_sort(items[mid:])
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out
'''
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{_TEXT[2]}",
    f"Copy this paragraph, fixing nothing and adding nothing:\n\n{_TEXT[3]}",
    f"Rewrite this Python function with the variable `out` renamed to `merged`. Reply "
    f"with the code only.\n\n{_CODE}",
    f"Repeat this code exactly:\n\n{_CODE}",
]
CHAT = [
    "Tell me a short story about a lighthouse keeper and a storm.",
    "What are three good habits for learning a new language?",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a friendly note inviting my neighbours to a garden party.",
]
WORKLOADS = {"grounded": GROUNDED, "chat": CHAT}
# k = 6 read best on both workloads once draft rows got cheap (Zen 4, Q4_1 SmolLM2, in
# one process, ratio to no speculation, grounded / chat): k = 4 with lookup 3..5 (the
# old default) 1.60x / 1.25x; lookup 2..5: k = 5 1.76x / 1.34x, k = 6 1.83x / 1.30x,
# k = 7 (before the bf16 attention kernel) 1.73x / 1.13x.
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 6}


def _run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Each prompt alone; (output tokens per second of wall time, the outputs)."""
    from kiln.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, seconds, outs = 0, 0.0, []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)
        outs.append(out.outputs[0].token_ids)
    return tokens / seconds, outs


def run_spec(make_llm: Callable[[bool], Any], output_len: int, repeats: int
             ) -> dict[str, Any]:
    engines = {"base": make_llm(False), "spec": make_llm(True)}
    stats = engines["spec"].engine.scheduler.spec_stats
    runs = {w: {c: [] for c in engines} for w in WORKLOADS}
    acceptance: dict[str, Any] = {}
    identical = True
    for rep in range(repeats + 1):  # round 0 warms every case up and is not kept
        for workload, prompts in WORKLOADS.items():
            outputs = {}
            # Alternate which engine goes first, so a drift within a repeat favours
            # neither over the run.
            order = list(engines) if rep % 2 else list(engines)[::-1]
            for case in order:
                llm = engines[case]
                before = stats.snapshot()
                tok_s, outputs[case] = _run(llm, prompts, output_len)
                if rep:
                    runs[workload][case].append(tok_s)
                if case == "spec" and rep == repeats:
                    acceptance[workload] = stats.since(before).as_dict()
            identical &= outputs["base"] == outputs["spec"]
    med = {w: {c: statistics.median(v) for c, v in cases.items()}
           for w, cases in runs.items()}
    # Each repeat's spec over base, the two run back to back: the host's drift over the
    # run (about 20% between repeats on a shared 2-core host) cancels in each ratio.
    paired = {w: [s / b for s, b in zip(cases["spec"], cases["base"])]
              for w, cases in runs.items()}
    spec_engine = engines["spec"].engine
    return {"mode": "spec", **environment(spec_engine.config.device),
            "config": {"output_len": output_len, "repeats": repeats,
                       "speculative": spec_engine.speculative.describe(),
                       **engine_facts(spec_engine)},
            "runs": runs, "median_tok_s": med,
            "speedup": {w: statistics.median(r) for w, r in paired.items()},
            "speedup_range": {w: [min(r), max(r)] for w, r in paired.items()},
            "acceptance": acceptance, "identical": identical}


def format_spec(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"speculative decoding ({c['speculative']}) vs none: batch 1, greedy, output "
            f"<= {c['output_len']}; -O{c['optimization_level']} {c['dtype']} "
            f"({r['device']}), median of {c['repeats']}; outputs identical: "
            f"{'yes' if r['identical'] else 'NO'}")
    rows = []
    for w, m in r["median_tok_s"].items():
        a = r["acceptance"].get(w, {})
        lo, hi = r["speedup_range"][w]
        rows.append([w, m["base"], m["spec"], f"{r['speedup'][w]:.2f}x ({lo:.2f}-{hi:.2f})",
                     a.get("acceptance_rate", float("nan")),
                     a.get("mean_accepted_length", float("nan")),
                     " ".join(f"{x:.2f}" for x in a.get("per_position_acceptance", []))])
    headers = ["workload", "base tok/s", "spec tok/s", "speedup", "acceptance",
               "mean accepted length", "per position"]
    return "\n".join([head, table(headers, rows, digits=2)])


def plot_spec(r: dict[str, Any], out_dir: Any) -> list[Any]:
    return []  # two rows say it all
