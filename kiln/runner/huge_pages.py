"""Transparent huge pages for the CPU weights (the KV cache stays on 4 KiB pages:
kiln.runner.kv_alloc.lazy_zeros says why).

A decode step streams every weight once, in ~120 calls of 0.2-1.1 MB each for SmolLM2. On
4 KiB pages each call starts its streams with TLB misses and page walks that the hardware
prefetchers cannot run ahead of; on 2 MiB pages one entry covers a whole weight. Measured
on Zen 4 (class avx512_bf16, 2 threads, `benchmarks/quant_step.py`-like 30 layers of Q4
weights, interleaved in one process): 3.54 -> 3.00 ms per step's linears.

Linux grants huge pages to private anonymous memory when
/sys/kernel/mm/transparent_hugepage/enabled is `always`, or `madvise` and the range was
advised (`MADV_HUGEPAGE`) before its first touch. So the weights are copied once, after
loading and packing, into one advised arena (a mapping of its own; each weight a storage
of its own within it), and each tensor is re-pointed at its copy in place
(`Tensor.set_`): every holder of the tensor object (modules, the compiled graph's input
recipe) sees the new memory. Elsewhere (other kernels, THP `never`) nothing moves.
"""
from __future__ import annotations

import logging
import mmap
import sys
from collections import defaultdict
from functools import lru_cache

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's copy starts on a cache line
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@lru_cache(maxsize=1)
def thp_mode() -> str | None:
    """The kernel's THP policy (`always`, `madvise`, `never`), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def available() -> bool:
    return thp_mode() in ("always", "madvise")


def _advised_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh private anonymous mapping with room for `nbytes` from a 2 MiB boundary, and
    that boundary's offset; its whole 2 MiB pages advised for huge pages before anything
    touches them. Memory from malloc may be pages already touched (glibc serves blocks
    below its adaptive mmap threshold, up to 32 MiB, from its heap), which the kernel does
    not back with huge pages at fault time."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    start = -address % HUGE_PAGE  # a multiple of the 4 KiB page: madvise wants one
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and available():
        mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return mapping, start


def _whole_storage(t: torch.Tensor) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _movable(model: nn.Module, min_bytes: int) -> list[list[torch.Tensor]]:
    """The CPU parameters and buffers grouped by storage, for storages of at least
    `min_bytes`; a storage that some module tensor, of any size, views only in part is
    left where it is (moving it would strand that view)."""
    groups: dict[int, list[torch.Tensor]] = defaultdict(list)
    seen: set[int] = set()
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False) if t is not None]
    for t in tensors:
        if t.device.type != "cpu" or id(t) in seen:
            continue
        seen.add(id(t))
        groups[t.untyped_storage().data_ptr()].append(t)
    return [g for g in groups.values()
            if g[0].untyped_storage().nbytes() >= min_bytes and all(map(_whole_storage, g))]


@torch.no_grad()
def move_weights_to_huge_pages(model: nn.Module, min_bytes: int = 64 << 10) -> int:
    """Copy the model's large CPU weights into one huge-page arena and re-point each
    tensor at its copy; returns the bytes moved (0 where THP is unavailable)."""
    if not available():
        return 0
    groups = _movable(model, min_bytes)
    sizes = [-(-g[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN for g in groups]
    if not groups:
        return 0
    mapping, start = _advised_mapping(sum(sizes))
    offset = start
    for group, size in zip(groups, sizes):
        first = group[0]
        n = first.untyped_storage().nbytes()
        # A storage of its own over its part of the one mapping: weights stay distinct
        # tensors to the compiler (a region's inputs may not alias one another), and
        # the mapping lives as long as any of them.
        copy = torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=offset)
        copy.copy_(first.detach().reshape(-1).view(torch.uint8))
        for t in group:  # each whole-storage tensor of this storage, same bytes
            t.set_(copy.untyped_storage(), 0, t.shape, t.stride())
        offset += size
    moved = offset - start
    logger.info("%.0f MiB of weights on transparent huge pages (THP %s)", moved / 2**20,
                thp_mode())
    return moved
