"""The measurement protocol every worker runs, so each engine does exactly the same work.

Standard library only: the peers' virtual environments import this file (it sits next to
the worker scripts, so it is on their `sys.path`) and have neither kiln nor numpy.

A worker builds an `Engine` (an adapter with one `generate` method) and calls `run`:

1. startup: one greedy token for a short prompt, straight after construction. Timed from
   the orchestrator's spawn time ($PEERS_T0, wall clock) to that token: imports, weight
   loading, compilation or cache loading, KV allocation, first forward.
2. warm-up: one short batched request set, untimed, so lazy one-off work (allocator,
   first-batch kernels) is not charged to the measured runs.
3. batch 1: for each repeat, a fresh prompt run for 1 token and another fresh prompt run for
   `new_tokens`; decode tok/s = (new_tokens - 1) / (median t_n - median t_1). Subtracting
   the 1-token time removes prefill and per-call overhead, using only each engine's public
   offline `generate` (no engine has to expose per-step timing). Fresh prompts every time:
   a prefix-cache hit must never flatter one engine.
4. batch N: N fresh prompts submitted at once, run to `new_tokens` each; tok/s = generated
   tokens / wall time (prefill included, as `kiln bench throughput` reports it).

The result is printed as one line `PEER_RESULT {json}` (engines log to stdout too, so the
orchestrator looks for the marker rather than the last line).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

MARKER = "PEER_RESULT "


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        """Greedy-decode every prompt to exactly `max_tokens` new tokens (EOS ignored);
        return the number of tokens generated in total."""
        ...


@dataclass(slots=True)
class Spec:
    """What the orchestrator asks of one worker process (written to a JSON file)."""

    model: str                      # Hugging Face model directory
    dtype: str                      # engine-specific dtype name ("auto" for kiln)
    new_tokens: int                 # per request, batch 1 and batch N alike
    startup_prompt: list[int]
    warmup_prompts: list[list[int]]
    batch1_prompts: list[list[int]]  # 2 per repeat: one for the 1-token run, one for t_n
    batchn_prompts: list[list[int]]
    startup_only: bool = False      # a warm-up process: build, first token, stop
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific extras

    @classmethod
    def load(cls, path: str) -> "Spec":
        with open(path) as f:
            return cls(**json.load(f))


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def measure(engine: Engine, spec: Spec, spawned: float) -> dict[str, Any]:
    engine.generate([spec.startup_prompt], 1)
    result: dict[str, Any] = {"startup_s": time.monotonic() - spawned}
    if spec.startup_only:
        return result
    engine.generate(spec.warmup_prompts, 4)
    n = spec.new_tokens
    t1s, tns = [], []
    pairs = spec.batch1_prompts
    for i in range(0, len(pairs) - 1, 2):
        t1s.append(_timed(lambda: engine.generate([pairs[i]], 1))[0])
        elapsed, got = _timed(lambda: engine.generate([pairs[i + 1]], n))
        if got != n:
            raise RuntimeError(f"batch 1 generated {got} tokens, expected {n}")
        tns.append(elapsed)
    t1, tn = statistics.median(t1s), statistics.median(tns)
    result.update(batch1_decode_tok_s=(n - 1) / (tn - t1) if tn > t1 else None,
                  batch1_output_tok_s=n / tn, batch1_first_token_s=t1,
                  batch1_samples_s={"t_1": t1s, "t_n": tns})
    elapsed, got = _timed(lambda: engine.generate(spec.batchn_prompts, n))
    expected = n * len(spec.batchn_prompts)
    if got != expected:
        raise RuntimeError(f"batch {len(spec.batchn_prompts)} generated {got} tokens, "
                           f"expected {expected}")
    result.update(batchn_tok_s=got / elapsed, batchn_elapsed_s=elapsed,
                  batchn_requests=len(spec.batchn_prompts))
    return result


def run(make_engine: Callable[[Spec], tuple[Engine, dict[str, Any]]]) -> int:
    """Worker entry point: `worker.py SPEC.json`. `make_engine` returns the engine and
    facts worth recording (versions, effective settings). Errors are reported in the
    result line (with a non-zero exit) so the orchestrator can show them as a row."""
    spawned = float(os.environ.get("PEERS_T0") or time.monotonic())
    out: dict[str, Any] = {}
    code = 0
    try:
        spec = Spec.load(sys.argv[1])
        engine, facts = make_engine(spec)
        out["facts"] = facts
        out.update(measure(engine, spec, spawned))
    except BaseException as exc:  # noqa: BLE001 - the orchestrator must get a row, not a hang
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    sys.stdout.flush()
    print(MARKER + json.dumps(out), flush=True)
    return code

