"""The sampler on known logits (statistics over many seeded draws) and on a real tiny model
(seeds give the same tokens alone or in a batch)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import random_prompts
from kiln import LLM, SamplingParams
from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.sampler import Sampler, apply_penalties, apply_top_k_top_p

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
DRAWS = 6000


@dataclass
class Row:
    """A request state as the runner keeps it (the fields the metadata builder reads)."""

    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [0, 1])
    num_prompt_tokens: int = 2
    eos_token_ids: tuple[int, ...] = (5,)
    generator: torch.Generator | None = None


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """Sample DRAWS rows of the same logits in one batch; return token frequencies."""
    torch.manual_seed(0)
    md = SamplingMetadata.build([Row(params)] * DRAWS, torch.device("cpu"), logits.numel())
    tokens = Sampler()(logits.expand(DRAWS, -1).clone(), md).sampled
    return torch.bincount(tokens, minlength=logits.numel()).float() / DRAWS


def expected(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    freq = frequencies(SamplingParams(temperature=temperature))
    assert torch.allclose(freq, (LOGITS / temperature).softmax(-1), atol=0.02)


def test_top_k_support_and_frequencies():
    freq = frequencies(SamplingParams(top_k=3))
    assert freq[3:].sum() == 0
    assert torch.allclose(freq, expected(LOGITS.softmax(-1), [0, 1, 2]), atol=0.02)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = LOGITS.softmax(-1)  # 0.44, 0.27, 0.16, 0.06, ...
    p = float(probs[:2].sum()) + 0.01  # needs the third token to reach p
    freq = frequencies(SamplingParams(top_p=p))
    assert freq[3:].sum() == 0 and freq[2] > 0
    assert torch.allclose(freq, expected(probs, [0, 1, 2]), atol=0.02)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_after_temperature():
    probs = (LOGITS / 2.0).softmax(-1)
    min_p = 0.5  # keeps tokens with p >= 0.5 * p_max: at T=2 that is tokens 0..2
    keep = [i for i in range(6) if probs[i] >= min_p * probs.max()]
    assert keep == [0, 1, 2]
    freq = frequencies(SamplingParams(temperature=2.0, min_p=min_p))
    assert freq[3:].sum() == 0
    assert torch.allclose(freq, expected(probs, keep), atol=0.02)


def test_partial_top_k_filter_equals_the_full_sort():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3
    top_k = torch.tensor([1, 5, 50, 50, 200, 7])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 0.3])
    full = apply_top_k_top_p(logits, top_k, top_p)
    partial = apply_top_k_top_p(logits, top_k, top_p, max_top_k=200)
    assert torch.equal(full, partial)


def test_greedy_and_random_rows_mix_in_one_batch():
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(top_k=2))] * 200
    md = SamplingMetadata.build(rows, torch.device("cpu"), 6)
    tokens = Sampler()(LOGITS.expand(len(rows), -1).clone(), md).sampled
    assert (tokens[0::2] == 0).all()
    assert set(tokens[1::2].tolist()) == {0, 1}


def test_penalties_change_logits_exactly_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt_mask = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 1.0]])
    md = SamplingMetadata.build([Row(SamplingParams(repetition_penalty=2.0,
                                                    frequency_penalty=0.5,
                                                    presence_penalty=0.25),
                                     token_ids=[0, 1, 2, 2, 3])],
                                torch.device("cpu"), 4)
    assert torch.equal(md.penalties.prompt_mask, prompt_mask)
    assert torch.equal(md.penalties.output_counts, counts)
    got = apply_penalties(logits, md.penalties)
    # repetition: positive seen logits / 2, negative seen ones x 2; then -0.5*count, -0.25.
    want = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0 / 2 - 0.5 - 0.25]])
    assert torch.allclose(got, want)


def test_logit_bias_and_min_tokens_change_the_greedy_choice():
    logits = LOGITS.clone().unsqueeze(0)
    biased = Row(SamplingParams(temperature=0, logit_bias={4: 10.0}))
    md = SamplingMetadata.build([biased], torch.device("cpu"), 6)
    assert Sampler()(logits, md).sampled.item() == 4
    assert torch.equal(logits, LOGITS.unsqueeze(0))  # the caller's logits are untouched
    eos_first = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0]])  # EOS (5) is the argmax
    short = Row(SamplingParams(temperature=0, min_tokens=3), token_ids=[0, 1, 7])
    md = SamplingMetadata.build([short], torch.device("cpu"), 6)
    assert Sampler()(eos_first, md).sampled.item() == 1
    done = Row(SamplingParams(temperature=0, min_tokens=1), token_ids=[0, 1, 7])
    md = SamplingMetadata.build([done], torch.device("cpu"), 6)
    assert Sampler()(eos_first, md).sampled.item() == 5


def test_logprobs_come_from_raw_logits_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    rows = [Row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0)),
            Row(SamplingParams(temperature=3.0, logit_bias={0: 50.0}, logprobs=0))]
    out = Sampler()(logits, SamplingMetadata.build(rows, torch.device("cpu"), 4))
    raw = logits.log_softmax(-1)
    lp = out.logprobs
    # The penalty and the bias decided the tokens; the logprobs ignore both.
    assert out.sampled.tolist() == [2, 0]
    assert torch.allclose(lp.logprobs[:, 0], raw[[0, 1], out.sampled])
    assert lp.token_ids[0, 1:].tolist() == [1, 2] and lp.ranks.tolist() == [2, 3]
    assert torch.allclose(lp.logprobs[0, 1:], raw[0, [1, 2]])


def test_seed_gives_same_tokens_alone_or_in_a_batch(tiny_models):
    llm = LLM(str(tiny_models["llama"][0]), progress=False, optimization_level=0, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, [4, 11, 23, 30])]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, seed=1234, max_tokens=16,
                            ignore_eos=True, repetition_penalty=1.2)
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 7
    batch = llm.generate(prompts, [seeded] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate(prompts[0], other, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.usefixtures("cpu_kernels_loaded")
@pytest.mark.parametrize("vocab", [1, 15, 49152 + 7])
def test_fused_greedy_argmax_equals_torch_argmax_with_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 4).to(torch.bfloat16)
    if vocab > 4:  # ties at the maximum: bf16 has 8 bits of mantissa, so they do happen
        logits[1, vocab // 2] = logits[1, 3] = 30.0
        logits[2, :] = 1.0
    ids = torch.ops.kiln_cpu.greedy_argmax(logits)
    assert ids.tolist() == logits.float().argmax(dim=-1).tolist()
    md = SamplingMetadata.build([Row(SamplingParams(temperature=0))] * 6, torch.device("cpu"),
                                vocab)
    assert Sampler()(logits, md).sampled.tolist() == ids.tolist()


@pytest.mark.usefixtures("cpu_kernels_loaded")
def test_fused_greedy_argmax_leaves_nan_and_inf_rows_to_aten():
    """NaN and +inf rows go to ATen; -inf (a grammar's masked tokens) stays in the kernel,
    including a row that is -inf everywhere (argmax 0, as ATen says)."""
    logits = torch.randn(5, 100).to(torch.bfloat16)
    logits[0, 70] = float("nan")
    logits[1, 9] = float("inf")
    logits[2, ::2] = float("-inf")
    logits[3, :] = float("-inf")
    logits[4, 95:] = float("-inf")  # in the scalar tail (100 = 6 x 16 + 4)
    ids = torch.ops.kiln_cpu.greedy_argmax(logits)
    assert ids[:2].tolist() == [-1, -1]
    assert ids[2:].tolist() == logits[2:].float().argmax(dim=-1).tolist()
    md = SamplingMetadata.build([Row(SamplingParams(temperature=0))] * 5, torch.device("cpu"),
                                100)
    # The sampler falls back to widening and ATen's argmax, NaN semantics included.
    assert Sampler()(logits, md).sampled.tolist() == logits.float().argmax(dim=-1).tolist()


def test_a_draw_at_the_top_of_the_unit_interval_never_lands_on_a_banned_token(monkeypatch):
    """Where U x total rounds up to the row's total, the draw is the last token with a
    non-empty interval, not the vocabulary's last token (banned here: probability 0)."""
    from kiln.sampling import sampler

    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0],
                          [0.25, 0.25, 0.25, 0.25]])
    monkeypatch.setattr(sampler.torch, "rand",
                        lambda *shape, **kw: torch.ones(*shape, dtype=torch.float64))
    assert sampler._draw(probs, {}).tolist() == [1, 1, 3]
