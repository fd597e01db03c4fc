"""Vocabulary-parallel embedding and lm_head: each rank holds a contiguous block of
`per_rank` vocabulary rows (the last block zero-padded when the vocabulary does not
divide), so tying the two shares one local tensor as before."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.collectives import tp_all_gather, tp_all_reduce
from kiln.distributed.parallel_state import tp_rank, tp_size
from kiln.models.layers import Linear
from kiln.models.linear import CheckpointTensor, copy_checked


def rows_per_rank(vocab_size: int) -> int:
    tp = tp_size()
    if tp == 1:
        return vocab_size
    per = -(-vocab_size // tp)
    return -(-per // 16) * 16  # a multiple of 16: the packed CPU kernel's tile


def _load_rows(param: nn.Parameter, weight: CheckpointTensor, vocab_size: int) -> None:
    per = param.shape[0]
    start = tp_rank() * per
    take = max(0, min(per, vocab_size - start))
    if weight.shape[0] != vocab_size:
        raise ValueError(f"vocabulary tensor has {weight.shape[0]} rows, expected "
                         f"{vocab_size}")
    param.data[take:].zero_()
    if take:
        copy_checked(param.data[:take], weight.narrow(0, start, take))


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(rows_per_rank(vocab_size), hidden)
        self.vocab_size = vocab_size

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (`load_weights` refuses
        one that lacks any), and the model is built on the meta device, where `normal_`
        runs a Python reference that imports Dynamo: about 0.5 s of an -O0 start."""

    def weight_loader(self, param: nn.Parameter, weight: CheckpointTensor,
                      shard: str | None) -> None:
        _load_rows(param, weight, self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        start = tp_rank() * self.num_embeddings
        local = ids - start
        mine = (local >= 0) & (local < self.num_embeddings)
        # Rows of other ranks read row 0 and are zeroed: the sum over ranks is exact.
        h = F.embedding(torch.where(mine, local, 0), self.weight)
        return tp_all_reduce(h * mine.unsqueeze(-1).to(h.dtype))


class ParallelLMHead(Linear):
    """Local logits for this rank's vocabulary block, gathered to the whole vocabulary
    (every rank gets them: the sampler then runs alike everywhere)."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__(hidden, rows_per_rank(vocab_size), bias=False)
        self.vocab_size = vocab_size

    def weight_loader(self, param: nn.Parameter, weight: CheckpointTensor,
                      shard: str | None) -> None:
        _load_rows(param, weight, self.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if tp_size() == 1:
            return logits
        return tp_all_gather(logits, -1)[..., : self.vocab_size]
