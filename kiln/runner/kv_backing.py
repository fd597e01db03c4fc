"""How the CPU KV cache's memory is backed: a lazy mapping, its first blocks at start-up,
the rest behind them on an idle-priority thread (`KILN_KV_PREFAULT` chooses).

The cache is one anonymous mapping that nothing writes at start-up (`lazy_zeros`): it
reads as zeros and the kernel backs each 4 KiB page at its first write. Left at that, a
prompt pays the faults of every page its blocks reach for the first time, inside the
attention op's KV write: about 11,000 faults per 2,000-token prompt of SmolLM2, 9-13 ms of
a 0.39 s prefill (AMX Xeon, in process, each prompt into unbacked pages against the same
pages backed). The pool hands out never-used blocks first (it keeps freed ones cached for
prefix hits), so every new prompt pays them until the whole cache has been used once.

So, by default, `back_kv_cache` faults the first blocks in at start-up (the runner joins
it before anything writes the cache), then starts `backfill`: the rest, in the order the
pool hands blocks out, with `madvise(MADV_POPULATE_WRITE)`, which backs a page as a write
would but changes no byte, so it may race the engine's own writes. It runs at SCHED_IDLE,
after the compile (see `start_backfill`), so it takes only a core nothing else wants.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref

import torch

logger = logging.getLogger(__name__)

FIRST_BYTES = 2 << 20  # of each layer's keys and values, at start-up
# Of each layer's keys and values per madvise call: about 0.3 ms of faults, so the mm
# lock the call holds never delays the engine's own mappings for long.
BACKFILL_BYTES = 1 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros that nothing writes, on 4 KiB pages (the KV cache; plain torch.zeros
    off Linux).

    A fresh anonymous mapping reads as zeros and the kernel backs each page at its first
    write, so a page no request reaches costs nothing. The cache was on huge pages first,
    like the weights; but with THP `defrag=madvise` a huge-page fault may compact memory
    (about 4 ms per 2 MiB on these VMs), and with prefix caching every new prompt takes
    blocks never used before (the pool keeps freed blocks cached as long as it can): on a
    2-vCPU Xeon, six distinct 2,000-token prompts one after another took 0.46, 0.44,
    0.74, 0.89, 1.02, 0.95 s on huge pages and 0.44, 0.43, 0.45, 0.52, 0.71, 0.48 s on
    4 KiB pages, while decode over 8 x 2,000 cached tokens was the same (2.74-3.07 vs
    2.77-2.81 s for 64 tokens). So the mapping is advised against huge pages (THP
    `always` would otherwise fault them in too)."""
    if not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=n).view(dtype).view(shape)


def back_kv_cache(buffer: torch.Tensor, mode: str) -> None:
    """Back the first FIRST_BYTES of every layer's keys and values now (all of them with
    mode "all"): the first requests' blocks lie there. It runs on a thread that the runner
    joins before anything writes the cache; its one indexed write holds no GIL and starts
    no OpenMP team, so the compiled code's loading, which is Python, runs beside it (warm
    `load` median 4.4 -> 3.8 s, on huge pages)."""
    per_block = _block_bytes(buffer)
    blocks = buffer.shape[2] if mode == "all" else _first_blocks(buffer)
    # One byte per 4 KiB page of each region, in one serial indexed write: the zeros are
    # there already, so this only faults. Nothing else writes the cache yet.
    region = torch.arange(0, blocks * per_block, 4096)
    starts = torch.arange(buffer.shape[0] * 2) * (buffer.shape[2] * per_block)
    buffer.view(-1).view(torch.uint8)[(starts[:, None] + region).flatten()] = 0


def start_backfill(buffer: torch.Tensor, mode: str) -> threading.Thread | None:
    """Back the rest of the cache on an idle-priority thread (mode ""; else None). Called
    once the model is compiled: a thread faulting the whole cache in while the model
    compiled made warm start-up slower (`load` 5.2-7.1 s against 3.4-4.0 s, huge pages,
    Zen 4), the faults contending with the compile's own mappings."""
    if mode != "" or not sys.platform.startswith("linux"):
        return None
    first = _first_blocks(buffer)
    if first >= buffer.shape[2]:
        return None
    thread = threading.Thread(target=backfill, args=(weakref.ref(buffer), first),
                              name="kiln-kv-backfill", daemon=True)
    thread.start()
    return thread


def backfill(ref: weakref.ref[torch.Tensor], start: int) -> None:
    """madvise(MADV_POPULATE_WRITE) over blocks [start, end) of every layer's keys and
    values, a step of blocks at a time across all layers (the pool's order: front first).
    Holds the cache only for a step, so an engine that is dropped frees it (the thread
    then stops). A kernel without the advice (before 5.14) leaves the rest lazy."""
    _idle_priority()
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    while (buffer := ref()) is not None:
        per_block, blocks = _block_bytes(buffer), buffer.shape[2]
        if start >= blocks:
            return
        stop = min(blocks, start + max(1, BACKFILL_BYTES // per_block))
        for region in range(buffer.shape[0] * 2):
            lo = buffer.data_ptr() + (region * blocks + start) * per_block
            page = lo - lo % mmap.PAGESIZE  # madvise wants a page-aligned start
            if madvise(page, lo + (stop - start) * per_block - page, MADV_POPULATE_WRITE):
                logger.debug("KV cache backfill stopped: %s", os.strerror(ctypes.get_errno()))
                return
        del buffer  # the engine may drop the cache between steps
        start = stop


def _idle_priority() -> None:
    """SCHED_IDLE for the calling thread (Linux schedules threads, not processes)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or a sandbox that forbids it
        pass


def _block_bytes(buffer: torch.Tensor) -> int:
    return buffer[0, 0, 0].numel() * buffer.element_size()


def _first_blocks(buffer: torch.Tensor) -> int:
    """The blocks whose pages back_kv_cache backs at start-up (FIRST_BYTES a layer)."""
    return max(1, min(buffer.shape[2], FIRST_BYTES // _block_bytes(buffer)))


def check_fits_in_memory(nbytes: int) -> None:
    """A CPU KV cache is not written at start-up (lazy_zeros), so the kernel would accept
    a size it cannot back and the engine would be killed mid-serving: refuse it here."""
    available = _mem_available()
    if available is not None and nbytes > available:
        raise ValueError(f"the KV cache needs {nbytes / 2**30:.1f} GiB but this machine has "
                         f"{available / 2**30:.1f} GiB available; lower kv_cache_memory "
                         "(or num_kv_blocks)")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
