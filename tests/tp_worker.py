"""Run by the tensor-parallel tests: one engine per case, greedy token ids out as JSON.

`python tp_worker.py CASES_JSON` (the `mp` executor: this process is the engine) or
`torchrun --nproc-per-node N tp_worker.py CASES_JSON` (`external_launcher`: every rank
runs it; rank 0 prints). Each case: {"model", "level", "tp", "backend"}, and optionally
"pp" (pipeline stages), "lora": a PEFT adapter directory for every prompt but the first
(LoRA sharded over the ranks), "prompts" (token-id lists instead of PROMPTS), "max_tokens",
"engine" (more LLM keyword arguments), "params" (SamplingParams keyword arguments per
prompt, a "regex" among them constraining that prompt) and "env" (variables set while the
case runs; the workers inherit them). Every result carries each rank's compile
counters, so a warm start can be checked per rank, and how many steps the engine had in
flight at most.
"""
from __future__ import annotations

import json
import os
import sys

from kiln import LLM, LoRARequest, SamplingParams

PROMPTS = [[1, 5, 9, 33, 7], [1, 300, 2, 77, 11, 12, 13, 14, 15, 16], [1, 42]]


def run(case: dict) -> dict:
    lora = case.get("lora")
    engine = {"num_kv_blocks": 64, "max_model_len": 128, **case.get("engine", {})}
    llm = LLM(case["model"], dtype="float32", optimization_level=case["level"],
              progress=False, tensor_parallel_size=case["tp"],
              pipeline_parallel_size=case.get("pp", 1),
              distributed_executor_backend=case.get("backend"), enable_lora=bool(lora),
              max_lora_rank=8, **engine)
    prompts = case.get("prompts", PROMPTS)
    params = [sampling(case.get("max_tokens", 12), extra)
              for extra in case.get("params", [{}] * len(prompts))]
    loras = [None] + [LoRARequest("a", 1, lora)] * (len(prompts) - 1) if lora else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    reports = llm.engine.executor.collective_rpc("compile_report")
    driver = llm.engine.executor.is_driver
    forked = [type(p).__name__ == "ForkedWorker"
              for p in getattr(llm.engine.executor, "procs", [])]
    batches = llm.engine.batch_queue
    stats = llm.engine.get_stats()
    spec = stats.spec_decoding
    llm.shutdown()
    return {"driver": driver, "tokens": [o.outputs[0].token_ids for o in outs],
            "counters": [r["counters"] for r in reports],
            "peak_in_flight": batches.peak if batches is not None else 1,
            "texts": [o.outputs[0].text for o in outs],
            "drafts_accepted": spec.num_accepted_tokens if spec is not None else 0,
            "prefix_hits": stats.prefix_cache_hits, "forked": forked}


def sampling(max_tokens: int, extra: dict) -> SamplingParams:
    from kiln.structured_output.params import StructuredOutputsParams

    extra = dict(extra)
    regex = extra.pop("regex", None)
    if "logit_bias" in extra:  # JSON keys are strings
        extra["logit_bias"] = {int(k): v for k, v in extra["logit_bias"].items()}
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=regex is None,
                          structured_outputs=None if regex is None
                          else StructuredOutputsParams(regex=regex), **extra)


def run_with_env(case: dict) -> dict:
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        return run(case)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    results = [run_with_env(case) for case in json.loads(sys.argv[1])]
    if results[0]["driver"]:
        print("RESULTS " + json.dumps(results), flush=True)
