"""Apply a packed token bitmask to logits: disallowed tokens get -inf, in place.

Bit j of word w of a row allows token 32w + j (xgrammar's layout). On a CPU with kiln's
kernels loaded, `kiln_cpu::apply_token_bitmask_` does it word by word (a fraction of a
millisecond per 32-row step at a 49k vocabulary); elsewhere (CUDA, or no kernels) a table
lookup in ATen does it (about 3 ms per such step on two CPU cores, cheap on a GPU).
"""
from __future__ import annotations

import torch

from kiln.ops import cpu_kernels

# [256, 8]: 0 where bit k of byte b is set (allowed), -inf where it is not.
_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
_BYTE_ADD = torch.where(_BYTE_BITS.bool(), 0.0, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool allowed."""
    return _byte_table(_BYTE_BITS.bool(), bitmask, vocab_size)


def apply_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                   kernel: bool = True) -> None:
    """Mask `logits` [R, V] in place: row rows[i] keeps only what bitmask[i] allows.
    `kernel=False` forces the ATen path (tests compare the two)."""
    bitmask = bitmask.to(logits.device)
    if (kernel and logits.device.type == "cpu" and cpu_kernels.loaded()
            and logits.is_contiguous()
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        torch.ops.kiln_cpu.apply_token_bitmask_(logits, rows.to(torch.int64), bitmask)
        return
    add = _byte_table(_BYTE_ADD.to(logits.dtype), bitmask, logits.shape[-1])
    logits[rows] = logits[rows] + add


def _byte_table(table: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Little-endian bytes: byte k of a word holds bits 8k..8k+7, so the bytes in memory
    # order are the tokens in order, eight at a time.
    table = table.to(bitmask.device)
    per_byte = table[bitmask.contiguous().view(torch.uint8).long()]  # [R, 4W, 8]
    return per_byte.reshape(bitmask.shape[0], -1)[:, :vocab_size]
