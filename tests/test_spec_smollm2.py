"""Speculative decoding on SmolLM2 in fp32 at -O2 (the warm-up's graph): n-gram and
SmolLM2 drafting for itself both equal transformers' greedy tokens; stop strings end
inside an accepted run exactly; streaming and n > 1 keep working."""
from __future__ import annotations

import pytest

from conftest import hf_greedy
from kiln import LLM, SamplingParams
from kiln.bench.spec import GROUNDED

pytestmark = pytest.mark.slow
MAX_NEW = 96


@pytest.fixture(scope="module")
def ngram_llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", optimization_level=2, progress=False,
               max_model_len=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def grounded(ngram_llm, smollm2_hf):
    prompts = [ngram_llm.apply_chat_template([{"role": "user", "content": p}])
               for p in GROUNDED[2:]]
    refs = [hf_greedy(smollm2_hf, p["prompt_token_ids"], MAX_NEW, stop_at_eos=True)
            for p in prompts]
    return prompts, refs


def test_ngram_greedy_equals_transformers_and_accepts_often(ngram_llm, grounded):
    prompts, refs = grounded
    outs = ngram_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, n=2),
                              use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert [c.token_ids for c in out.outputs] == [ref, ref]
    spec = ngram_llm.engine.get_stats().spec_decoding
    assert spec.acceptance_rate > 0.3 and spec.mean_accepted_length > 2.0


def test_stop_string_inside_accepted_tokens_ends_exactly_there(ngram_llm, grounded):
    prompts, refs = grounded
    tok = ngram_llm.get_tokenizer()
    full = tok.decode(refs[1], skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 6]
    cut = full.index(stop)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop])
    before = ngram_llm.engine.get_stats().spec_decoding.num_accepted_tokens
    deltas = list(ngram_llm.generate_stream([prompts[1]], params))
    text = "".join(d.outputs[0].text for d in deltas if d.outputs)
    ids = [t for d in deltas if d.outputs for t in d.outputs[0].token_ids]
    assert text == full[:cut] and deltas[-1].outputs[0].finish_reason == "stop"
    # The output ends at the token that completed the stop string, not after it.
    assert ids == refs[1][: len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    assert ngram_llm.engine.get_stats().spec_decoding.num_accepted_tokens > before


def test_smollm2_drafting_for_itself_accepts_nearly_everything(smollm2_dir, grounded):
    """The first half of each reference answer (a draft model costs k forwards a step:
    the whole answers took 24 s of the suite's budget)."""
    prompts, refs = grounded
    llm = LLM(str(smollm2_dir), dtype="float32", optimization_level=2, progress=False,
              max_model_len=512,
              speculative_config={"method": "draft_model", "model": str(smollm2_dir),
                                  "num_speculative_tokens": 3})
    n = MAX_NEW // 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r in refs]
    spec = llm.engine.get_stats().spec_decoding
    assert spec.num_draft_tokens > 50 and spec.acceptance_rate > 0.9
