"""Speculative decoding on CUDA: n-gram and draft-model drafts verified under FULL graphs
keyed on "uniform decode with 1 + k tokens", greedy tokens equal to decoding without
speculation."""
from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PREFIX = [7, 8, 9, 10, 11, 12, 13, 14] * 3
PROMPTS = [PREFIX + [5, 6, 7, 8, 5, 6, 7], PREFIX + [3, 4, 3, 4, 3], PREFIX + [40, 41]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _run(path, level, tmp_path, **kwargs):
    llm = LLM(str(path), device="cuda", dtype="float32", optimization_level=level,
              progress=False, max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
              compilation={"cudagraph_capture_sizes": [1, 2, 4, 8],
                           "cache_dir": str(tmp_path)}, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_spec_under_full_graphs_equals_plain_decoding(tiny_models, tmp_path, spec):
    path = tiny_models["llama"][0]
    _, plain = _run(path, 0, tmp_path / "plain")
    cfg = NGRAM if spec == "ngram" else {"method": "draft_model", "model": str(path),
                                         "num_speculative_tokens": 3}
    llm, outs = _run(path, 2, tmp_path / "spec", speculative_config=cfg)
    assert outs == plain
    stats = llm.engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0  # drafts were verified (n-gram ones may all fail
    if spec == "draft_model":          # on a random model's output)
        assert stats.acceptance_rate > 0.95  # the same weights: drafts match
    runner = llm.engine.runner
    assert 4 in runner.dispatcher.uniform_query_lens  # 1 + k is a graph key
    assert any(w.num_replays > 0 for w in runner.graph_wrappers)
