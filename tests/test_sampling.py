"""Sampling on a real (tiny) model: seeds, top-k support, greedy rows mixed with random."""
from __future__ import annotations

import torch

from conftest import random_prompts
from kiln import LLM, SamplingParams
from kiln.sampling import Sampler, SamplingMetadata


def test_seed_gives_same_tokens_alone_or_in_a_batch(tiny_models):
    llm = LLM(str(tiny_models["llama"][0]), progress=False, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, [4, 11, 23, 30])]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 7
    batch = llm.generate(prompts, [seeded] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate(prompts[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_sampler_top_k_support_and_greedy_rows():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0, top_k=2),
              SamplingParams(temperature=5.0, top_p=0.5)]
    counts = torch.zeros(3, 5)
    sampler = Sampler()
    for i in range(400):
        gens = {1: torch.Generator().manual_seed(i), 2: torch.Generator().manual_seed(10_000 + i)}
        md = SamplingMetadata.build(params, gens, torch.device("cpu"))
        for row, tok in enumerate(sampler(logits, md).tolist()):
            counts[row, tok] += 1
    assert counts[0, 1] == 400  # greedy row: always the argmax
    assert counts[1, [0, 3, 4]].sum() == 0 and counts[1, 1] > 100 and counts[1, 2] > 100
    # top_p=0.5 at temperature 5: tokens 1 and 2 carry ~0.25 each, so the nucleus holds
    # tokens 1, 2 (0.5 reached only after the second).
    assert counts[2, [0, 3, 4]].sum() == 0 and counts[2, 1] > 100 and counts[2, 2] > 100
