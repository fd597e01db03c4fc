"""Synthetic workloads: prompt lengths and random prompt token ids, reproducible by seed.

Random token ids make the prompt length exact (no tokenizer round trip) and make every
prompt distinct, so the prefix cache cannot turn a benchmark into a cache benchmark.
"""
from __future__ import annotations

import random


def lengths(n: int, mean: int, range_ratio: float, rng: random.Random,
            field: str) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], each at least 1 (r = 0 gives
    exactly `mean`). `field` names the flag in error messages."""
    if mean < 1:
        raise ValueError(f"{field}={mean} must be at least 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} must be in [0, 1)")
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_prompts(lens: list[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    """One list of token ids per length. Ids 0..2 are skipped: they are usually special
    (pad / bos / eos), and a prompt full of them is not a realistic one."""
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(n)] for n in lens]


def check_positive(**fields: int) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
