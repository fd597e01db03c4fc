"""`kiln bench structured`: what a grammar costs per engine step, side by side.

The same N requests run three ways per repeat, interleaved so the host's drift hits each:
  free         no constraint (EOS ignored: all N stay in the batch)
  mixed        every other request under the JSON schema below, the rest free
  constrained  every request under the schema, whose strings are unbounded so the
               requests keep generating (the grammar may end them; they then leave)
Only decode steps with all N requests in the batch are timed, and of those only the ones
at output lengths every case reached that way, so every case compares the same batch
shape and the same context lengths. `overhead` is the median such step of a case over
`free`, minus one: it covers the scheduler's bitmask fill, the matchers' advance and the mask in the sampler.
In `mixed` each free request still gets one token per step, so its throughput there is
`free_share_of_throughput` = free step / mixed step of what it gets alone (1.0: nothing
lost). Compile times: `compile_cold_ms` (the schema's first parse and compile in the
process) and `compile_cached_ms` (an equal constraint again: the manager's cache).
JSON: mode "structured", environment, config, runs {case: [median step ms per repeat]},
median_step_ms, overhead {mixed, constrained}, free_share_of_throughput, compile_*_ms,
fill_ms_per_step (the scheduler's bitmask fill per step of the last constrained run: the
grammar's own host cost, without the step-to-step noise of the ratios).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from kiln.bench.report import engine_facts, environment, repeats_table

SCHEMA = {"type": "object", "required": ["title", "chapters"], "properties": {
    "title": {"type": "string"},
    "chapters": {"type": "array", "items": {
        "type": "object", "required": ["heading", "text", "mood"],
        "properties": {"heading": {"type": "string"}, "text": {"type": "string"},
                       "mood": {"enum": ["calm", "tense", "happy", "sad"]},
                       "pages": {"type": "integer", "minimum": 1, "maximum": 500}}}}}}
TOPICS = ("a lighthouse", "a kiln", "a comet", "a river", "a robot", "a forest", "a city",
          "a ship")
CASES = {"free": 0, "mixed": 2, "constrained": 1}  # every k-th request constrained (0: none)


def _prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} (number {i}) as JSON "
            "with a title and several chapters." for i in range(n)]


def _decode_steps(engine: Any, n: int) -> dict[int, float]:
    """Run until done; {i: seconds} for each step that decoded exactly n requests, by the
    requests' output length i (so cases compare steps over the same context lengths)."""
    times = {}
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == n and not engine.scheduler.waiting and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in running)
        length = running[0].num_output_tokens if full else -1
        start = time.perf_counter()
        engine.step()
        if full:
            times[length] = time.perf_counter() - start
    return times


def _run_case(llm: Any, n: int, output_len: int, every: int, tag: str) -> dict[int, float]:
    from kiln.sampling.params import RequestOutputKind, SamplingParams
    from kiln.structured_output.params import StructuredOutputsParams

    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA),
                                 output_kind=RequestOutputKind.FINAL_ONLY)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(n)):
        params = constrained if every and i % every == 0 else free
        engine.add_request(f"{tag}-{i}", prompt, params)
    return _decode_steps(engine, n)


def _compile_times(engine: Any) -> tuple[float, float]:
    from kiln.structured_output.params import StructuredOutputsParams

    manager = engine.structured_output_manager()
    times = []
    for _ in range(2):  # cold (parse and compile), then an equal constraint again
        start = time.perf_counter()
        manager.submit(StructuredOutputsParams(json=SCHEMA)).result()
        times.append(1e3 * (time.perf_counter() - start))
    return times[0], times[1]


def run_structured(llm: Any, num_prompts: int, output_len: int,
                   repeats: int) -> dict[str, Any]:
    engine = llm.engine
    cold_ms, cached_ms = _compile_times(engine)
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    manager = engine.scheduler.structured
    for rep in range(repeats + 1):  # the first round warms every case up and is not kept
        times = {}
        for name, every in CASES.items():
            if name == "constrained":
                fill_s, fill_steps = manager.fill_s, manager.fill_steps
            times[name] = _run_case(llm, num_prompts, output_len, every, f"{name}-{rep}")
        # Constrained requests may end early: compare only steps every case ran full.
        common = set.intersection(*(set(t) for t in times.values()))
        for name in runs if rep and common else ():
            runs[name].append(1e3 * statistics.median(times[name][i] for i in common))
    fill_ms = 1e3 * (manager.fill_s - fill_s) / max(1, manager.fill_steps - fill_steps)
    med = {name: statistics.median(v) if v else float("nan") for name, v in runs.items()}
    return {"mode": "structured", **environment(engine.config.device),
            "config": {"num_prompts": num_prompts, "output_len": output_len,
                       "repeats": repeats, **engine_facts(engine)},
            "runs": runs, "median_step_ms": med,
            "overhead": {n: med[n] / med["free"] - 1 for n in ("mixed", "constrained")},
            "free_share_of_throughput": med["free"] / med["mixed"],
            "compile_cold_ms": cold_ms, "compile_cached_ms": cached_ms,
            "fill_ms_per_step": fill_ms}


def format_structured(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"structured: {c['num_prompts']} requests, output {c['output_len']}, decode "
            f"steps with all {c['num_prompts']} in the batch; -O{c['optimization_level']} "
            f"{c['dtype']} ({r['device']}), median of {c['repeats']}\n"
            f"schema compile: cold {r['compile_cold_ms']:.1f} ms, cached "
            f"{r['compile_cached_ms']:.3f} ms; free requests in the mixed batch keep "
            f"{100 * r['free_share_of_throughput']:.1f}% of their throughput; filling the "
            f"bitmask takes {r['fill_ms_per_step']:.2f} ms per all-constrained step")
    return "\n".join([head, repeats_table(r["runs"], r["median_step_ms"], r["overhead"],
                                          "free", "step ms", digits=2)])


def plot_structured(r: dict[str, Any], out_dir: Any) -> list[Any]:
    return []  # three rows say it all
