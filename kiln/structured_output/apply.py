"""Apply a packed token bitmask to logits: disallowed tokens get -inf."""
from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 (bit j of word w = token 32*w + j) -> [R, vocab_size] bool allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit reads 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                  ) -> torch.Tensor:
    """A copy of `logits` [R, V] whose `rows` keep only their allowed tokens."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
