"""Sampler: logits [R, V] -> token ids [R] (and logprobs), all rows in one batch.

The order is vLLM v1's, and order is semantics:
  grammar bitmask (structured output: as vLLM, before the sampler, so logprobs are those
  of the constrained distribution) -> raw logprobs snapshot -> float32 -> logit bias / min_tokens bans (they change the argmax,
  so they come before greedy) -> penalties -> greedy result -> temperature -> min_p ->
  top-k/top-p -> sample -> greedy rows keep the greedy token.
Penalties come before temperature so a penalty means the same at every temperature.
Random rows draw by inverse transform (one uniform per row against the running sum of p);
each seeded row draws its uniform from its own generator, so its tokens do not depend on
what else is in the batch.
The sampler is stateless: everything per step is in `SamplingMetadata`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ops import cpu_kernels
from kiln.sampling.logprobs import LogprobsTensors, gather_logprobs
from kiln.sampling.metadata import Penalties, SamplingMetadata
from kiln.sampling.params import _GREEDY_EPS
from kiln.structured_output.apply import apply_bitmask_


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None  # column 0 = the sampled token
    # With `keep=True` (speculative verification): the final distribution of every row
    # ([R, V] float32, None when every row is greedy) and the raw log-softmax (None when
    # no row asked for logprobs), so accepted draft tokens can be scored afterwards.
    probs: torch.Tensor | None = None
    raw_logprobs: torch.Tensor | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 keep: bool = False) -> SamplerOutput:
        if md.grammar is not None:  # in place: the runner's logits are this step's alone
            apply_bitmask_(logits, md.grammar.rows, md.grammar.bitmask)
        fast = _fused_greedy(logits, md)
        if fast is not None:
            return SamplerOutput(fast, None)
        logits = logits.float()
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        sparse = [s for s in (md.logit_bias, md.min_tokens_mask) if s is not None]
        if sparse:
            logits = logits.clone()  # the caller's logits stay as they were
            for entries in sparse:
                logits.index_put_((entries.rows, entries.tokens), entries.values,
                                  accumulate=True)
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        sampled = logits.argmax(dim=-1)
        probs = None
        if not md.all_greedy:
            probs = self.final_probs(logits, md)
            is_greedy = md.temperature < _GREEDY_EPS
            sampled = torch.where(is_greedy, sampled, _draw(probs, md.generators))
        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        if keep:
            return SamplerOutput(sampled, lp, probs, raw_logprobs)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def final_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: temperature, min_p, top-k/top-p
        applied to float32 logits that already carry bias, bans and penalties."""
        is_greedy = md.temperature < _GREEDY_EPS
        temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
        logits = logits / temperature.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.max_top_k)
        return logits.softmax(dim=-1)


def _fused_greedy(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
    """All-greedy bf16 steps with nothing to apply before the argmax (no logprobs, bias,
    bans or penalties) read the logits once in kiln's C++ argmax: the same first-maximum
    answer as widening to fp32 and `argmax`, without the copy. None: the general path
    (also for a row with a NaN or infinity, which the kernel leaves to ATen)."""
    if not (md.all_greedy and md.max_num_logprobs is None and md.logit_bias is None
            and md.min_tokens_mask is None and md.penalties is None
            and logits.dtype == torch.bfloat16 and logits.device.type == "cpu"
            and logits.dim() == 2 and cpu_kernels.loaded()):
        return None
    sampled = torch.ops.kiln_cpu.greedy_argmax(logits)
    return None if bool((sampled < 0).any()) else sampled


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (prompt and output tokens): positive logits divided by the penalty,
    negative ones multiplied. Frequency: minus penalty x count in the output. Presence:
    minus penalty once for any token already in the output."""
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = torch.where(seen, p.repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency.unsqueeze(1) * p.output_counts
    return logits - p.presence.unsqueeze(1) * (p.output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None = None
                      ) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf.

    With `max_top_k` (every row has 0 < top_k <= max_top_k) only the best max_top_k
    logits per row are sorted; the rest are dropped either way."""
    if top_k is None and top_p is None:
        return logits
    if max_top_k is not None:
        sorted_logits, order = logits.topk(max_top_k, dim=-1)  # sorted, descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    width = sorted_logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, width)).clamp(max=width)
        drop |= torch.arange(width, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        drop |= before >= top_p.unsqueeze(1)  # the top token always survives (before = 0)
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.full_like(logits, float("-inf")) if max_top_k is not None \
        else torch.empty_like(logits)
    return out.scatter_(-1, order, masked)


def _draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of `probs`: the first whose running sum exceeds U x the row's total.
    One uniform per row instead of noise over the vocabulary (the exponential race): 0.84
    against 10.4 ms for 32 rows of a 49,152-token vocabulary (Zen 4, two threads). The sum
    is float64: float32 drifts by up to ~1e-3 over that many terms, more than a rare
    token's probability. A token of probability 0 spans an empty interval and is never
    drawn: where U x total rounds up to the total (about 2^-53), the draw is the last token
    whose interval is not empty (the first to reach the total), never one past it."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:].contiguous()  # searchsorted copies a strided value tensor
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gen)
    drawn = torch.searchsorted(cdf, u * total, right=True)
    return torch.minimum(drawn, torch.searchsorted(cdf, total)).squeeze(1)
