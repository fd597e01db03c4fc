"""Verification of draft tokens against one target forward (the rejection sampler).

Request r with drafts d_1..d_k has k + 1 sampling rows: row j is the target's next-token
distribution p_j after the prefix plus d_1..d_j (row 0: after the real tokens alone).
- Greedy requests accept the longest prefix of drafts equal to the target's argmax, then
  take the argmax of the first row that disagrees (or of row k: the bonus token). The
  output is exactly what decoding without speculation gives.
- Random requests use the standard rejection sampler. Both proposers draft
  deterministically, so the draft distribution q is one-hot: d_j is accepted with
  probability p_j(d_j); on the first rejection a token is drawn from the residual
  max(p_j - q, 0), i.e. p_j without d_j, renormalised; when all k are accepted the bonus
  is drawn from p_k. Every output token is then distributed exactly as p (Leviathan et
  al. 2023). A seeded request draws its uniforms and residuals from its own generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.sampling.params import SamplingParams
from kiln.sampling.sampler import SamplerOutput


@dataclass(slots=True)
class DraftRows:
    """One sampling request of a verification step: rows first .. first + len(drafts)."""

    first: int
    drafts: list[int]
    params: SamplingParams
    generator: torch.Generator | None


def verify(out: SamplerOutput, requests: list[DraftRows]) -> list[list[int]]:
    """The tokens each request emits this step: accepted drafts plus one more."""
    sampled = out.sampled.tolist()
    accept_p = _draft_probs(out, requests)
    result = []
    for i, r in enumerate(requests):
        k = len(r.drafts)
        if out.probs is None or r.params.is_greedy:
            a = 0
            while a < k and sampled[r.first + a] == r.drafts[a]:
                a += 1
            result.append(r.drafts[:a] + [sampled[r.first + a]])
        else:
            result.append(_rejection(out.probs, r, accept_p.get(i, []), sampled[r.first + k]))
    return result


def _draft_probs(out: SamplerOutput, requests: list[DraftRows]) -> dict[int, list[float]]:
    """p_j(d_j) for every draft token of a random request, in one gather and transfer."""
    if out.probs is None:
        return {}
    rows, tokens, owners = [], [], []
    for i, r in enumerate(requests):
        if r.params.is_greedy or not r.drafts:
            continue
        rows.extend(range(r.first, r.first + len(r.drafts)))
        tokens.extend(r.drafts)
        owners.extend([i] * len(r.drafts))
    if not rows:
        return {}
    dev = out.probs.device
    values = out.probs[torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)]
    by_owner: dict[int, list[float]] = {}
    for owner, v in zip(owners, values.tolist()):
        by_owner.setdefault(owner, []).append(v)
    return by_owner


def _rejection(probs: torch.Tensor, r: DraftRows, p_draft: list[float],
               bonus: int) -> list[int]:
    dev = r.generator.device if r.generator is not None else probs.device
    uniforms = torch.rand(len(r.drafts), generator=r.generator, device=dev).tolist()
    for j, (d, p, u) in enumerate(zip(r.drafts, p_draft, uniforms)):
        if u < p:
            continue
        residual = probs[r.first + j].clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p was all on d (u < p fails only at u = p = 1)
            return r.drafts[: j + 1]
        token = int(torch.multinomial(residual, 1, generator=_device_gen(r, residual)))
        return r.drafts[:j] + [token]
    return r.drafts + [bonus]


def _device_gen(r: DraftRows, t: torch.Tensor) -> torch.Generator | None:
    gen = r.generator
    return gen if gen is None or gen.device == t.device else None
