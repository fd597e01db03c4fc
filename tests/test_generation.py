"""Generation features end to end: logprobs against transformers, stop strings across
token boundaries, streamed deltas, n > 1 sharing the prompt's KV blocks."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from kiln import LLM, SamplingParams
from kiln.config.engine import EngineConfig
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.output_text import OutputText
from kiln.sampling.params import RequestOutputKind

QUESTION = [{"role": "user", "content": "Describe a kiln in two sentences."}]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", progress=False, optimization_level=0, max_model_len=512)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.apply_chat_template(QUESTION)


@pytest.fixture(scope="module")
def greedy(llm, prompt):
    """The unconstrained greedy answer: token ids and text."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


@pytest.mark.slow
def test_logprobs_match_transformers(llm, prompt, smollm2_hf):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = prompt["prompt_token_ids"]
    with torch.no_grad():
        hf = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        prompt_logits = smollm2_hf(torch.tensor([ids])).logits[0]
    completion = out.outputs[0]
    assert completion.token_ids == hf.sequences[0, len(ids):].tolist()
    for token, entry, logits in zip(completion.token_ids, completion.logprobs, hf.logits):
        ref = logits[0].float().log_softmax(-1)
        assert abs(entry[token].logprob - ref[token].item()) < 1e-4
        assert entry[token].rank == 1
        top = [t for t in entry if entry[t].rank <= 5]
        assert top == ref.topk(5).indices.tolist()
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)))
    ref = prompt_logits.log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1


def _split_stop(llm, token_ids: list[int], text: str) -> tuple[str, int, int]:
    """A 4-character stop string straddling a token boundary, its first occurrence in
    `text`, and how many tokens it takes to complete it."""
    tok = llm.get_tokenizer()
    for i in range(3, len(token_ids) - 1):
        cut = len(tok.decode(token_ids[:i]))
        stop = text[cut - 2: cut + 2]
        if len(stop) == 4 and stop.isprintable() and text.find(stop) == cut - 2 \
                and len(tok.decode(token_ids[: i + 1])) >= cut + 2:
            return stop, cut - 2, i + 1
    raise AssertionError("no token boundary with two printable characters on each side")


@pytest.mark.slow
def test_stop_string_across_tokens(llm, prompt, greedy):
    ids, text = greedy
    stop, at, num_tokens = _split_stop(llm, ids, text)
    base = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=["@@never@@", stop])
    out = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:at], "stop", stop)
    assert out.token_ids == ids[:num_tokens]
    kept = llm.generate(prompt, SamplingParams(**base, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: at + len(stop)]


@pytest.mark.slow
def test_streamed_deltas_concatenate_and_never_show_cut_text(llm, prompt, greedy):
    ids, text = greedy
    stop, at, _ = _split_stop(llm, ids, text)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                            logprobs=1)
    final = llm.generate(prompt, params, use_tqdm=False)[0]
    streamed = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list] = {0: [], 1: []}
    deltas = 0
    finishes = {0: 0, 1: 0}
    for out in llm.generate_stream(prompt, params):
        for c in out.outputs:
            finishes[c.index] += c.finish_reason is not None
            streamed[c.index] += c.text
            tokens[c.index] += c.token_ids
            logprobs[c.index] += c.logprobs
            deltas += 1
            # Held back: nothing shown is ever cut off later.
            assert text[:at].startswith(streamed[c.index])
    assert deltas == len(tokens[0]) + len(tokens[1])  # one delta per sample per token
    assert finishes == {0: 1, 1: 1}  # each sample reports its finish exactly once
    for c in final.outputs:
        assert streamed[c.index] == c.text == text[:at]
        assert tokens[c.index] == c.token_ids and logprobs[c.index] == c.logprobs


@pytest.mark.parametrize("stop,expect", [("🏺", "emoji: 🔥"), ("摄氏2", "温度是"),
                                         ("é d", "emoji: 🔥🏺 done, caf")])
def test_multibyte_text_and_stop_strings(smollm2_dir, stop, expect):
    from kiln.engine.startup import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    text = "温度是摄氏25度。" if stop == "摄氏2" else "emoji: 🔥🏺 done, café des arts"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    out = OutputText(SamplingParams(stop=[stop]))
    found = None
    for n, t in enumerate(ids, 1):
        delta = detok.update([t])
        assert "\ufffd" not in delta  # never half a character
        found = out.append(delta, n)
        if found:
            break
    assert found == stop and out.text == expect


def test_n_samples_share_the_prompt_blocks(tiny_models):
    config = EngineConfig(model=str(tiny_models["llama"][0]), max_model_len=128,
                          block_size=16, num_kv_blocks=64, optimization_level=0)
    engine = LLMEngine(config, progress=False)
    prompt = random_prompts(1, [40])[0]  # 2 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    pool = engine.scheduler.kv.block_pool
    free_before = pool.get_num_free_blocks()
    outputs = engine.step()
    kv = engine.scheduler.kv
    tables = [kv.get_block_ids(f"{i}_r")[0] for i in range(4)]  # the one group
    assert all(t[:2] == tables[0][:2] for t in tables)  # the full prompt blocks, shared
    assert len({t[2] for t in tables}) == 4  # each sample's partial block is its own
    assert all(kv.req_to_blocks["0_r"][j].ref_cnt == 4 for j in range(2))
    assert free_before - pool.get_num_free_blocks() == 2 + 4
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # seeds 7, 8, 9, 10
    assert pool.get_num_free_blocks() == free_before  # all freed (hashed ones stay cached)
    engine.add_request("a", {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.abort_request("a")  # aborting the user request aborts every sample
    assert not engine.has_unfinished_requests()
    assert pool.get_num_free_blocks() == free_before
    # A sample id that collides with a live request rejects the new request whole.
    engine.add_request("0_b", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        done = engine.step()
    assert [o.request_id for o in done] == ["0_b"]
