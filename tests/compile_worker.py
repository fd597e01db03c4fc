"""Run a tiny -O1 engine in a fresh process and print what the compiler did (JSON).

    python compile_worker.py MODEL_DIR CACHE_DIR
"""
from __future__ import annotations

import json
import subprocess
import sys

from kiln import LLM, SamplingParams
from kiln.compiler.counter import compilation_counter

PROMPTS = [[5, 9, 13, 200, 7], [100, 3, 44], list(range(3, 40))]


COMPILER_CALLS: list[str] = []
CHILD_PYTHONS: list[str] = []  # Inductor's vector-ISA probe dlopens its builds in these


def _audit_compiler_calls() -> None:
    """Record every C/C++ compiler invocation (version probes aside) and every child
    Python this process makes."""
    original = subprocess.Popen.__init__

    def init(self, args, *a, **k):
        cmd = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        words = cmd.split()
        if words and words[0].rsplit("/", 1)[-1] in ("g++", "gcc", "c++", "cc", "clang++") \
                and not {"--version", "-v", "-dumpversion"} & set(words):
            COMPILER_CALLS.append(cmd[:200])
        if words and words[0] == sys.executable:
            CHILD_PYTHONS.append(cmd[:200])
        original(self, args, *a, **k)

    subprocess.Popen.__init__ = init


def main() -> None:
    _audit_compiler_calls()
    model, cache_dir = sys.argv[1], sys.argv[2]
    before = compilation_counter.clone()
    llm = LLM(model, optimization_level=1, progress=False, max_model_len=128,
              dtype="float32", attention_backend="torch",
              max_num_batched_tokens=64, compilation={"cache_dir": cache_dir})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    print(json.dumps({"counters": compilation_counter.delta(before),
                      "tokens": [o.outputs[0].token_ids for o in outs],
                      "cache": str(llm.engine.runner.compile_backend.cache.dir),
                      "compiler_calls": COMPILER_CALLS, "child_pythons": CHILD_PYTHONS}))


if __name__ == "__main__":
    main()
