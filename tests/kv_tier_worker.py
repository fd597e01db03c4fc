"""A child process for tests/test_kv_transfer.py: runs prompts through a tiny engine with
the disk tier and prints the greedy outputs and the connector's counters as JSON.

argv: MODEL_DIR TIER_DIR PROMPTS_JSON [MAX_TOKENS]
"""
from __future__ import annotations

import json
import sys

from kiln import LLM, SamplingParams


def main() -> None:
    model, tier, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    llm = LLM(model, dtype="float32", progress=False, optimization_level=0,
              max_model_len=256, kv_transfer_config={
                  "kv_connector": "disk", "kv_connector_extra_config": {"path": tier}})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.flush_kv_saves()
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "stats": llm.engine.get_stats().kv_transfer.as_dict(),
                      "prefix_cache_hits": llm.engine.get_stats().prefix_cache_hits}))


if __name__ == "__main__":
    main()
