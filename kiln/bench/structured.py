"""`kiln bench structured`: what a grammar costs per engine step, side by side.

The same N requests run twice per repeat, interleaved so the host's drift hits both:
  free         no constraint (EOS ignored: all N stay in the batch)
  constrained  every request under one JSON schema whose strings are unbounded, so the
               requests keep generating (the grammar may end them; they then leave)
Only decode steps with all N requests in the batch are timed, so both sides compare the
same batch shape; the overhead is the median such step of `constrained` over `free`,
minus one. It covers the scheduler's bitmask fill, the matchers' advance and the mask in
the sampler. JSON: mode "structured", environment, config, runs {name: [step_ms...]},
median_step_ms, overhead, compile_ms (the schema's first compile).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from kiln.bench.report import engine_facts, environment, table

SCHEMA = {"type": "object", "required": ["title", "chapters"], "properties": {
    "title": {"type": "string"},
    "chapters": {"type": "array", "items": {
        "type": "object", "required": ["heading", "text", "mood"],
        "properties": {"heading": {"type": "string"}, "text": {"type": "string"},
                       "mood": {"enum": ["calm", "tense", "happy", "sad"]},
                       "pages": {"type": "integer", "minimum": 1, "maximum": 500}}}}}}
TOPICS = ("a lighthouse", "a kiln", "a comet", "a river", "a robot", "a forest", "a city",
          "a ship")


def _prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} (number {i}) as JSON "
            "with a title and several chapters." for i in range(n)]


def _decode_steps(engine: Any, n: int) -> list[float]:
    """Run until done; the seconds of each step that decoded exactly n requests."""
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == n and not engine.scheduler.waiting and all(
            r.num_tokens - r.num_computed_tokens == 1 for r in running)
        start = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - start)
    return times


def _run_case(llm: Any, n: int, output_len: int, constrained: bool, tag: str) -> list[float]:
    from kiln.sampling import RequestOutputKind, SamplingParams
    from kiln.structured_output import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=not so,
                            structured_outputs=so, output_kind=RequestOutputKind.FINAL_ONLY)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(n)):
        engine.add_request(f"{tag}-{i}", prompt, params)
    return _decode_steps(engine, n)


def run_structured(llm: Any, num_prompts: int, output_len: int,
                   repeats: int) -> dict[str, Any]:
    from kiln.structured_output import StructuredOutputsParams
    from kiln.structured_output.backend import grammar_for

    engine = llm.engine
    so = StructuredOutputsParams(json=SCHEMA)
    manager = engine._structured_outputs(_with(so))  # builds the vocabulary tables
    start = time.perf_counter()
    grammar_for(so)
    manager.submit(so).result()
    compile_ms = 1e3 * (time.perf_counter() - start)
    runs: dict[str, list[float]] = {"free": [], "constrained": []}
    for rep in range(repeats + 1):  # the first round warms both up and is not kept
        for name in runs:
            times = _run_case(llm, num_prompts, output_len, name == "constrained",
                                 f"{name}-{rep}")
            if rep and times:
                runs[name].append(1e3 * statistics.median(times))
    med = {name: statistics.median(v) if v else float("nan") for name, v in runs.items()}
    return {"mode": "structured", **environment(engine.config.device),
            "config": {"num_prompts": num_prompts, "output_len": output_len,
                       "repeats": repeats, **engine_facts(engine)},
            "runs": runs, "median_step_ms": med, "compile_ms": compile_ms,
            "overhead": med["constrained"] / med["free"] - 1}


def _with(so: Any) -> Any:
    from kiln.sampling import SamplingParams
    return SamplingParams(structured_outputs=so)


def format_structured(r: dict[str, Any]) -> str:
    c = r["config"]
    head = (f"structured: {c['num_prompts']} requests, output {c['output_len']}, decode "
            f"steps with all {c['num_prompts']} in the batch; -O{c['optimization_level']} "
            f"{c['dtype']} ({r['device']}), median of {c['repeats']}; schema compiled in "
            f"{r['compile_ms']:.0f} ms")
    rows = [[name, r["median_step_ms"][name], *r["runs"][name],
             "" if name == "free" else f"{100 * r['overhead']:+.1f}%"] for name in r["runs"]]
    headers = ["run", "median step ms", *[f"#{i + 1}" for i in range(c["repeats"])],
               "overhead"]
    return "\n".join([head, table(headers, rows, digits=2)])


def plot_structured(r: dict[str, Any], out_dir: Any) -> list[Any]:
    return []  # two rows say it all
