"""transformers worker: `python worker_transformers.py SPEC.json` (kiln's venv has it).

Eager `generate` with its default dynamic KV cache, greedy, as users run it; batched
prompts are left-padded as batched generation requires (the same way
`benchmarks/compare_hf.py` does). `min_new_tokens = max_new_tokens` makes EOS impossible,
so every request generates exactly `max_tokens` like `ignore_eos` in the other engines.
"""
from __future__ import annotations

from typing import Any

import measure


class HFEngine:
    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        import torch

        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=self.pad_id)
        return (out.shape[1] - width) * len(prompts)


def make_engine(spec: measure.Spec) -> tuple[HFEngine, dict[str, Any]]:
    import torch
    import transformers

    dtype = getattr(torch, spec.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    facts = {"engine": "transformers", "transformers": transformers.__version__,
             "torch": torch.__version__, "threads": torch.get_num_threads(),
             "dtype": spec.dtype}
    return HFEngine(model, pad), facts


if __name__ == "__main__":
    raise SystemExit(measure.run(make_engine))
