"""llama.cpp worker: `python worker_llamacpp.py SPEC.json` in the llama-cpp-python venv.

It runs the GGUF file itself (`spec.options["gguf"]`: the embedded SmolLM2's Q4_1 file,
the same weights kiln runs natively), greedy (top_k=1), with as many threads as CPUs.
`Llama.generate` yields tokens without stopping at EOS, so taking exactly `max_tokens`
of them is `ignore_eos`. llama-cpp-python's high-level API decodes one sequence at a
time: the N-request row runs the prompts one after another (its throughput as that API
offers it; batch 1 is the comparison that matters for this peer).
"""
from __future__ import annotations

import os
from typing import Any

import measure


class LlamaCppEngine:
    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        total = 0
        for prompt in prompts:
            self.llm.reset()
            for i, _ in enumerate(self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0,
                                                    reset=True)):
                if i + 1 == max_tokens:
                    break
            total += max_tokens
        return total


def make_engine(spec: measure.Spec) -> tuple[LlamaCppEngine, dict[str, Any]]:
    import llama_cpp

    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    llm = llama_cpp.Llama(model_path=spec.options["gguf"], n_ctx=2048, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False,
                          seed=0)
    facts = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
             "threads": threads, "gguf": os.path.basename(spec.options["gguf"])}
    return LlamaCppEngine(llm), facts


if __name__ == "__main__":
    raise SystemExit(measure.run(make_engine))
