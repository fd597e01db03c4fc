"""Run by tests/test_plugins.py in a fresh process whose PYTHONPATH holds the installed
example plugin package: build an engine, generate, and print what the plugins did as JSON.

    python plugin_worker.py MODEL_DIR TP [IO_PROCESSOR]
"""
from __future__ import annotations

import json
import sys

from kiln import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 2, 9], [100, 7, 7, 40], [12, 80, 3, 3, 3, 61, 4]]


def main(model_dir: str, tp: int, io_processor: str | None) -> dict:
    llm = LLM(model_dir, dtype="float32", optimization_level=0, num_kv_blocks=256,
              max_num_seqs=8, tensor_parallel_size=tp, io_processor_plugin=io_processor,
              progress=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    from kiln.platforms import current_platform

    loggers = llm.engine.stat_loggers
    result = {"tokens": [o.outputs[0].token_ids for o in outs],
              "platform": type(current_platform).__name__,
              "configs_checked": getattr(type(current_platform), "configs_checked", None),
              "prefix_caching": llm.engine.config.enable_prefix_caching,
              "stat_loggers": [type(s).__name__ for s in loggers],
              "stat_generation_tokens": sum(getattr(s, "generation_tokens", 0) for s in loggers),
              "stat_prompt_tokens": sum(getattr(s, "prompt_tokens", 0) for s in loggers)}
    if io_processor:
        words = ["Hello", "The sky is"]
        result["process"] = llm.process({"words": words, "max_tokens": 3})
        result["direct"] = [o.outputs[0].text for o in llm.generate(
            words, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            use_tqdm=False)]
        try:
            llm.process({"words": []})
        except ValueError as exc:
            result["bad_input"] = str(exc)
    llm.shutdown()
    return result


if __name__ == "__main__":
    out = main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    print("RESULT " + json.dumps(out))
