"""Sampler: logits [R, V] -> token ids [R], greedy and random rows mixed in one batch.

Order: float32 -> greedy result -> temperature -> top-k/top-p -> sample. Random rows use
the exponential-race trick (argmax of p / Exp(1)), drawing each seeded row's noise from
its own generator so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.params import _GREEDY_EPS


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy
        is_greedy = md.temperature < _GREEDY_EPS
        temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        sampled = (probs / _exponential_noise(probs, md.generators)).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        drop |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        drop |= before >= top_p.unsqueeze(1)  # the top token always survives (before = 0)
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def _exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return q
