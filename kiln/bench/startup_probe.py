"""Child process of `kiln bench compile`: start an engine, generate one token, report.

    python -m kiln.bench.startup_probe [engine args as for `kiln generate`]

Prints one JSON line: load_s (engine construction: load, trace, compile or cache load),
first_token_s (one greedy token after that), startup_s (from the parent's spawn time in
$KILN_PROBE_T0 to the first token) and the compilation-counter deltas.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from kiln import envs


def main(argv: list[str] | None = None) -> int:
    from kiln.entrypoints.args import add_engine_args, make_llm

    parser = argparse.ArgumentParser(prog="kiln.bench.startup_probe")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    from kiln.compiler.counter import compilation_counter
    from kiln.sampling.params import SamplingParams

    before = compilation_counter.clone()
    t0 = time.perf_counter()
    llm = make_llm(args)
    t1 = time.perf_counter()
    vocab = llm.engine.model_config.vocab_size
    llm.generate({"prompt_token_ids": [min(3, vocab - 1)] * 8},
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    t2 = time.perf_counter()
    # CLOCK_MONOTONIC is one clock for every process on the host and never jumps; the wall
    # clock can (a clock step once made start-up outlast the whole process in CI).
    spawned = envs.KILN_PROBE_T0
    counters = compilation_counter.delta(before)
    print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t1,
                      "startup_s": time.monotonic() - spawned,
                      "artifacts_loaded": counters["num_compiled_artifacts_loaded"],
                      "compiles": counters["num_inductor_compiles"]
                      + counters["num_eager_compiles"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
