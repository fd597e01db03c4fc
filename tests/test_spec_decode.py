"""Speculative decoding on tiny random models: greedy outputs equal decoding without it
(and transformers) under preemption, chunked prefill and prefix hits, at -O0 and -O2;
the rejection sampler keeps the target distribution; bad configuration fails at start-up.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from conftest import TINY, hf_greedy
from kiln import LLM, SamplingParams
from kiln.compiler.counter import compilation_counter
from kiln.config.speculative import SpeculativeConfig, parse_speculative_config
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.sampling.sampler import SamplerOutput
from kiln.spec_decode.ngram import NgramProposer
from kiln.spec_decode.rejection import DraftRows, verify

# Drafts by the requests' tokens alone: these tests need drafts to be made (and some to
# be accepted) whatever the host's timing; the measured-cost default is tested below and
# on SmolLM2 (test_spec_smollm2.py).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "draft_length": "deterministic"}
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Repetitive prompts (the drafts find matches), a shared prefix (prefix-cache hits) and a
# long one (chunked prefill under a small token budget).
PREFIX = [7, 8, 9, 10, 11, 12, 13, 14] * 3
PROMPTS = [PREFIX + [5, 6, 7, 8, 5, 6, 7], PREFIX + [3, 4, 3, 4, 3],
           [20 + (i % 11) for i in range(70)], PREFIX + [40, 41, 42]]


def _run(path, prompts, params=GREEDY, **kwargs) -> tuple[LLM, list]:
    llm = LLM(str(path), dtype="float32", progress=False, max_model_len=128,
              optimization_level=kwargs.pop("optimization_level", 0), **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_models):
    path, model = tiny_models["llama"]
    refs = [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    return path, refs


def test_ngram_proposer_takes_the_longest_latest_match():
    p = NgramProposer(k=3, lookup_min=1, lookup_max=3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # latest of two
    assert p.propose([5, 1, 2, 7, 2, 8, 1, 2]) == [7, 2, 8]  # "1 2" beats the later "2"
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence of the suffix
    assert p.propose([4, 1, 2, 4], k=1) == [1]
    assert NgramProposer(3, 2, 3).propose([9, 4, 1, 2, 4]) == []  # below lookup_min
    # The search runs over the tokens' int32 bytes: 2**24 then 0 hold the bytes of 1 across
    # a token boundary, which is no occurrence of token 1; the real one further left is.
    assert NgramProposer(2, 1, 1).propose([2 ** 24, 0, 1]) == []
    assert NgramProposer(2, 1, 1).propose([1, 7, 2 ** 24, 0, 1]) == [7, 2 ** 24]


def test_ngram_token_bytes_follow_a_growing_sequence():
    """The drafter keeps each request's TokenBytes across steps; proposals from it equal
    proposals from scratch as the sequence grows (and after it restarts shorter)."""
    from kiln.spec_decode.ngram import TokenBytes

    p, index = NgramProposer(k=4, lookup_min=2, lookup_max=4), TokenBytes()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (8,), generator=g).tolist()
    for _ in range(40):
        assert p.propose(tokens, index=index) == p.propose(tokens)
        tokens += torch.randint(0, 6, (3,), generator=g).tolist()
    tokens = tokens[:5]
    assert p.propose(tokens, index=index) == p.propose(tokens)


@pytest.mark.parametrize("draft_length,params", [
    ("cost", SamplingParams(temperature=1.0, seed=3)),  # seeded: always by its tokens
    ("deterministic", SamplingParams(temperature=0.0)),
])
def test_token_rule_draft_length_shrinks_after_a_rejection_and_grows_back(draft_length,
                                                                          params):
    """A seeded random request's draft length (every request's with draft_length
    "deterministic") depends on its own tokens alone, never on measured step costs: cut
    at position a -> a + 1 tokens, taken whole -> twice as many, never past k. Rows cost
    here as much as whole steps, and it still drafts."""
    from kiln.runner.drafter import NgramDrafter
    from kiln.runner.state import CachedRequestState

    drafter = NgramDrafter(SpeculativeConfig("ngram", 4, 1, 1, draft_length=draft_length))
    for tokens in range(1, 6):
        drafter.observe_step(tokens, float(tokens))
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 9, 7]  # lookup (1-grams) drafts what followed before
    s = CachedRequestState("r", list(prompt), [[0]], 10, params, None, 10, (0,))

    def step(emitted: list[int]) -> list[int]:  # accepted drafts, then the bonus token
        s.token_ids += emitted
        s.spec_token_ids = drafter.propose([], [s]).get("r", [])
        return s.spec_token_ids

    assert step([]) == [1, 2, 3, 4]  # no history yet: k
    assert step([1, 5]) == [6, 8]  # 1 of 4 taken: at most 2 next
    assert step([6, 8, 9]) == [7, 1, 5, 6]  # both taken: 2 * 2
    assert step([7, 1, 5, 6, 8]) == [9, 7, 1, 5]  # all taken: stays at k
    assert step([3]) == [4]  # the first rejected: 1
    assert step([4, 5]) == [6, 8]  # taken: 2


def test_draft_lengths_follow_measured_step_costs_and_learned_acceptance():
    """Whole drafts while no step was measured or rows are nearly free; none where a row
    costs as much as a step; a draft whose tokens keep being rejected is cut where it
    stops paying, one whose tokens keep being accepted stays whole."""
    from kiln.spec_decode.draft_length import AcceptanceStats, StepCosts, choose_lengths

    stats, costs = AcceptanceStats(k=6), StepCosts()
    chances = {"a": stats.cumulative(1, 6), "b": stats.cumulative(1, 3)}
    assert choose_lengths(chances, 2, costs) == {"a": 6, "b": 3}  # nothing measured
    for n in (2, 5, 11):
        costs.observe(n, 1.0 + 0.001 * n)  # a GPU: rows nearly free
    assert choose_lengths(chances, 2, costs) == {"a": 6, "b": 3}
    costs = StepCosts()
    for n in (1, 4, 8):
        costs.observe(n, float(n))  # compute-bound: a row costs as much as a step
    assert choose_lengths({"a": stats.cumulative(1, 6)}, 1, costs) == {"a": 0}
    costs = StepCosts()
    for n in (1, 7):
        costs.observe(n, 1.0 + 0.05 * (n - 1))  # a row is 5% of a step
    assert choose_lengths({"a": stats.cumulative(1, 6)}, 1, costs) == {"a": 6}
    for _ in range(200):
        stats.record(1, 6, 0)  # the first token always rejected: drafting does not pay
        stats.record(2, 6, 6)  # long matches taken whole
    assert stats.cumulative(1, 6)[0] < 0.05 < 0.9 < stats.cumulative(2, 6)[-1]
    chances = {"a": stats.cumulative(1, 6), "b": stats.cumulative(2, 6)}
    assert choose_lengths(chances, 2, costs) == {"a": 0, "b": 6}
    assert costs.cost(4) == pytest.approx(1.15) and costs.cost(13) == pytest.approx(1.6)


def test_decode_step_timer_times_only_back_to_back_decode_steps():
    """A step is timed from its start to the next one's, and only where both are decode
    steps (one token per request plus drafts): not across a prefill or an idle gap."""
    from types import SimpleNamespace

    from kiln.runner.step_timer import DecodeStepTimer

    seen: list[tuple[int, float]] = []
    timer = DecodeStepTimer(lambda n, s: seen.append((n, s)))

    def step(scheduled: dict[str, int], drafts: dict[str, list[int]]) -> None:
        timer.start(SimpleNamespace(num_scheduled_tokens=scheduled, is_empty=not scheduled,
                                    total_num_scheduled_tokens=sum(scheduled.values()),
                                    scheduled_spec_decode_tokens=drafts))

    step({"a": 3, "b": 1}, {"a": [5, 6]})  # decode with drafts: 4 tokens
    step({"a": 1, "b": 1}, {})  # decode: times the last one
    step({"a": 1, "c": 40}, {})  # a prefill comes in: the last decode is not timed
    step({"a": 1, "c": 1}, {})
    step({}, {})  # nothing to run
    step({"a": 1}, {})
    assert [n for n, _ in seen] == [4] and seen[0][1] >= 0


def test_ngram_drafter_stops_drafting_where_rows_cost_whole_steps():
    """Greedy requests: once steps are measured to cost in proportion to their tokens
    and drafts keep failing, the drafter proposes none (every 64th step still drafts
    whole, to measure again)."""
    from kiln.runner.drafter import EXPLORE_EVERY, NgramDrafter
    from kiln.runner.state import CachedRequestState

    drafter = NgramDrafter(SpeculativeConfig("ngram", 4, 2, 2))
    prompt = [5, 6, 1, 2, 3, 4, 5, 6]  # the suffix 5 6 matches: drafts 1 2 3 4
    s = CachedRequestState("r", list(prompt), [[0]], 8, SamplingParams(temperature=0.0),
                           None, 8, (0,))
    assert drafter.propose([], [s]) == {"r": [1, 2, 3, 4]}  # nothing measured yet
    for n in range(1, 6):
        drafter.observe_step(n, 0.01 * n)
    got = []
    for _ in range(2 * EXPLORE_EVERY):
        # Every step sees the prompt again; to the drafter its draft (if any) was then
        # verified with nothing accepted (no token past where it proposed).
        s.spec_token_ids = drafter.propose([], [s]).get("r", [])
        got.append(len(s.spec_token_ids))
    assert got.count(4) <= 3 and got[-EXPLORE_EVERY:].count(0) >= EXPLORE_EVERY - 1


def test_greedy_ngram_equals_plain_decoding_under_preemption_and_prefix_hits(plain):
    path, refs = plain
    # 14 usable blocks of 16 tokens for four requests of up to 102 tokens: preemption;
    # a 48-token budget chunks the 70-token prompt; PREFIX is shared.
    llm, outs = _run(path, PROMPTS, num_kv_blocks=15, max_num_batched_tokens=48,
                     speculative_config=NGRAM)
    assert _tokens(outs) == refs
    stats = llm.engine.get_stats()
    spec = stats.spec_decoding
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # accepted and rejected
    assert spec.num_drafts > 0 and 1.0 < spec.mean_accepted_length <= 5.0
    assert len(spec.per_position_acceptance) == 4
    pool = llm.engine.scheduler.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1  # nothing leaked
    text = ServerMetrics(llm.engine.get_stats).render().decode()  # what /metrics serves
    assert f"kiln:spec_decode_num_accepted_tokens_total {spec.num_accepted_tokens}.0" in text
    assert f"kiln:spec_decode_num_draft_tokens_total {spec.num_draft_tokens}.0" in text
    assert 'kiln:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert "kiln:spec_decode_mean_accepted_length" in text


def test_greedy_ngram_at_o2_compiles_nothing_while_serving(plain):
    path, refs = plain
    llm = LLM(str(path), dtype="float32", progress=False, max_model_len=128,
              optimization_level=2, speculative_config=NGRAM)
    before = compilation_counter.clone()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert not any(compilation_counter.delta(before).values())
    assert _tokens([o.outputs[0] for o in outs]) == refs
    assert llm.engine.get_stats().spec_decoding.num_accepted_tokens > 0


def test_stop_token_inside_drafts_max_tokens_and_logprobs_match_plain(plain):
    path, refs = plain
    stop = refs[0][9]  # somewhere inside a multi-token step, likely
    cut = refs[0].index(stop) + 1
    params = [SamplingParams(temperature=0, max_tokens=27, ignore_eos=True,
                             stop_token_ids=stops, logprobs=2) for stops in ([stop], [])]
    _, base = _run(path, PROMPTS[:2], params)
    _, outs = _run(path, PROMPTS[:2], params, speculative_config=NGRAM)
    assert _tokens(outs) == _tokens(base)
    assert outs[0].token_ids == refs[0][:cut] and outs[0].finish_reason == "stop"
    assert len(outs[1].token_ids) == 27 and outs[1].finish_reason == "length"
    for o, b in zip(outs, base):
        assert len(o.logprobs) == len(o.token_ids)
        for got, want, tok in zip(o.logprobs, b.logprobs, o.token_ids):
            assert set(got) == set(want)
            assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)
        assert o.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_draft_model_drafting_for_itself_accepts_everything(plain):
    path, refs = plain
    cfg = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm, outs = _run(path, PROMPTS, num_kv_blocks=15, speculative_config=cfg)
    assert _tokens(outs) == refs
    spec = llm.engine.get_stats().spec_decoding
    assert llm.engine.get_stats().num_preemptions > 0
    assert spec.num_draft_tokens > 50 and spec.acceptance_rate > 0.95


def test_draft_lookahead_never_needs_more_than_max_model_len(plain):
    """A cache that holds exactly one max_model_len request: the draft's lookahead slots
    stop at max_model_len, so the request still runs to the end (it could not otherwise
    be scheduled even alone)."""
    path, _ = plain
    cfg = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), dtype="float32", progress=False, optimization_level=0,
              max_model_len=64, num_kv_blocks=5, speculative_config=cfg)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[2][:30]}],
                          SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 34 and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_with_drafts_is_reproducible(plain):
    path, _ = plain
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=s,
                             ignore_eos=True) for s in (1, 2)]
    runs = [_tokens(_run(path, PROMPTS[:2], params, speculative_config=NGRAM)[1])
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


# ---- the rejection sampler preserves the target distribution ----------------------------
_CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59]


def _chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    cells = [c for c in probs if probs[c] * n >= 5]  # pool the rare cells
    stat, rest_obs, rest_exp = 0.0, n, n
    for c in cells:
        e = probs[c] * n
        stat += (counts.get(c, 0) - e) ** 2 / e
        rest_obs -= counts.get(c, 0)
        rest_exp -= e
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells.append(None)
    return stat, len(cells) - 1


def test_rejection_sampler_emits_the_target_distribution():
    """Two draft positions against known p: the first emitted token follows p_0, the
    second (after an accepted first draft) p_1, the bonus p_2."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1],
                          [0.25, 0.25, 0.25, 0.25]])
    drafts, n = [1, 1], 6000
    first, second = {}, {}
    for _ in range(n):
        sampled = torch.multinomial(probs, 1, generator=g).squeeze(1)
        out = SamplerOutput(sampled, None, probs)
        (tokens,) = verify(out, [DraftRows(0, drafts, SamplingParams(temperature=1.0), g)])
        first[tokens[0]] = first.get(tokens[0], 0) + 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] = second.get(tokens[1], 0) + 1
    stat, df = _chi2(first, dict(enumerate(probs[0].tolist())), n)
    assert stat < _CHI2_999[df - 1], (first, stat)
    m = sum(second.values())
    assert m == pytest.approx(0.3 * n, rel=0.1)  # accepted with p_0(d) = 0.3
    stat, df = _chi2(second, dict(enumerate(probs[1].tolist())), m)
    assert stat < _CHI2_999[df - 1], (second, stat)


def test_engine_sampling_with_drafts_matches_transformers_distribution(tmp_path):
    """A tiny model whose prompt holds every token, so the lookup drafts after whatever
    comes first; the joint law of the first two sampled tokens (top-k 3, temperature 1)
    over 1,500 samples must fit transformers' probabilities."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 48, "initializer_range": 0.08})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(tmp_path)
    prompt = torch.randperm(48, generator=torch.Generator().manual_seed(1)).tolist()
    # max_tokens 3: one draft (for the second token) fits before the last token.
    params = SamplingParams(n=1500, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype="float32", progress=False, optimization_level=0,
              max_model_len=64, speculative_config=NGRAM, max_num_seqs=128)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    spec = llm.engine.get_stats().spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    counts: dict = {}
    for c in out.outputs:
        key = tuple(c.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1

    def top3(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = logits.topk(3)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    joint = {(a, b): pa * pb for a, pa in top3(prompt).items()
             for b, pb in top3(prompt + [a]).items()}
    stat, df = _chi2(counts, joint, 1500)
    assert stat < _CHI2_999[df - 1], (counts, joint, stat)


# ---- configuration -----------------------------------------------------------------------
@pytest.mark.parametrize("value,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_length": "fixed"},
     "draft_length"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
      "draft_length": "deterministic"}, "draft_length"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(value)


def test_config_defaults_and_json():
    cfg = parse_speculative_config(json.dumps({"method": "ngram",
                                               "num_speculative_tokens": 3}))
    assert cfg == SpeculativeConfig("ngram", 3, 2, 5) and cfg.draft_length == "cost"
    assert SpeculativeConfig("ngram", 2, prompt_lookup_max=2).prompt_lookup_min == 2


def test_draft_with_another_vocabulary_is_a_startup_error(plain, tmp_path):
    path, _ = plain
    torch.manual_seed(0)
    other = transformers.LlamaConfig(**{**TINY, "vocab_size": 256})
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_config.model.*vocab_size 256"):
        LLM(str(path), dtype="float32", progress=False, optimization_level=0,
            speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})
