"""Size and allocate the paged KV cache: one allocation, one view per cache slot.

Layers map to slots through their KV-cache group (kiln.kv_cache.kv_cache_spec): with one
group every layer has its own slot; with several, layer j of every group shares slot j,
each group addressing its own blocks of it.
"""
from __future__ import annotations

import mmap
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from kiln import envs
from kiln.attention.backend import AttentionLayerSpec
from kiln.kv_cache.kv_cache_spec import (AttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
                                         SlidingWindowSpec, describe_groups, group_layers,
                                         group_size)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither size field is given
PREFAULT_BYTES = 2 << 20  # of each layer's keys and values, at start-up


def layer_kv_spec(layer: AttentionLayerSpec, block_size: int,
                  dtype: torch.dtype) -> AttentionSpec:
    if layer.sliding_window is not None:
        return SlidingWindowSpec(block_size, layer.num_kv_heads, layer.head_size, dtype,
                                 layer.sliding_window)
    return FullAttentionSpec(block_size, layer.num_kv_heads, layer.head_size, dtype)


def num_blocks_for(spec: AttentionSpec, num_slots: int, kv_cache_memory: int | None,
                   num_kv_blocks: int | None) -> int:
    """Blocks of the shared pool: a block takes one page in each of `num_slots` slots."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    blocks = memory // (spec.page_size_bytes * num_slots)
    if blocks < 2:
        raise ValueError(f"kv_cache_memory={memory} bytes holds {blocks} blocks; one block "
                         f"of all layers needs {spec.page_size_bytes * num_slots} bytes, "
                         "raise kv_cache_memory")
    return blocks


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


def allocate_kv_cache(spec: AttentionSpec, num_slots: int, num_blocks: int,
                      device: torch.device
                      ) -> tuple[torch.Tensor, list[torch.Tensor], threading.Thread | None]:
    """Returns the backing tensor, per-slot views of shape
    [2, num_blocks, block_size, num_kv_heads, head_size], and on a CPU the thread that
    backs its first blocks (`prefault_first_blocks`: join it before anything writes the
    cache). Zeroed: stale values in a fresh block must never reach attention (NaN * 0 is
    still NaN)."""
    shape = (num_slots, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    if device.type == "cpu":
        check_fits_in_memory(torch.Size(shape).numel() * spec.dtype.itemsize)
    buffer = (lazy_zeros(shape, spec.dtype) if device.type == "cpu"
              else torch.zeros(shape, dtype=spec.dtype, device=device))
    ready = None
    if device.type == "cpu":
        ready = threading.Thread(target=prefault_first_blocks, args=(buffer,),
                                 name="kiln-kv-prefault", daemon=True)
        ready.start()
    return buffer, list(buffer.unbind(0)), ready


def prefault_first_blocks(buffer: torch.Tensor) -> None:
    """Back the first 2 MiB of every layer's keys and values now. lazy_zeros leaves the
    cache untouched (touching all of it cost 0.8-2.4 s of each start when it was on huge
    pages), and the pool hands out blocks from the front, so the first requests' blocks
    all lie in these pages: without this the first request paid their faults (0.45 s of
    a short chat answer, on huge pages). The rest is backed as requests reach it. It runs
    on a thread: its one indexed write holds no GIL and starts no OpenMP team, so the
    compiled code's loading, which is Python, runs beside it (warm `load` median 4.4 ->
    3.8 s, on huge pages)."""
    per_block = buffer[0, 0, 0].numel() * buffer.element_size()
    blocks = max(1, min(buffer.shape[2], PREFAULT_BYTES // per_block))
    if envs.KILN_KV_PREFAULT == "all":  # steady memory from the start (a soak measures it)
        blocks = buffer.shape[2]
    # One byte per 4 KiB page of each region (a fault backs the page, huge or not), in
    # one serial indexed write: the zeros are there already, so this only faults.
    region = torch.arange(0, blocks * per_block, 4096)
    starts = torch.arange(buffer.shape[0] * 2) * (buffer.shape[2] * per_block)
    buffer.view(-1).view(torch.uint8)[(starts[:, None] + region).flatten()] = 0


def check_fits_in_memory(nbytes: int) -> None:
    """A CPU KV cache is not touched at start-up (lazy_zeros), so the kernel would accept
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


def layer_placement(groups: list[KVCacheGroupSpec],
                    num_layers: int) -> tuple[list[int], list[int], int]:
    """(group of each layer, cache slot of each layer, number of slots)."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of, group_size(groups)


@dataclass(slots=True)
class KVCacheLayout:
    groups: list[KVCacheGroupSpec]
    spec: AttentionSpec  # group 0's (all groups share its page size)
    layer_groups: list[int]
    num_blocks: int
    buffer: torch.Tensor  # [slots, 2, blocks, block_size, kv_heads, head_size]
    caches: list[torch.Tensor]  # per layer: its slot's view
    ready: threading.Thread | None  # backing the first blocks: join before writing any

    def describe(self) -> str:
        mib = self.buffer.numel() * self.buffer.element_size() / 2**20
        return (f"KV cache {self.num_blocks} blocks x {self.spec.block_size} tokens x "
                f"{self.buffer.shape[0]} slot(s) ({mib:.1f} MiB); "
                f"{describe_groups(self.groups)}")


def build_kv_cache(layers: Sequence[AttentionLayerSpec], block_size: int, dtype: torch.dtype,
                   device: torch.device, kv_cache_memory: int | None,
                   num_kv_blocks: int | None) -> KVCacheLayout:
    """KV-cache groups from the layers' specs, one shared pool of blocks, and each
    layer's view of its cache slot."""
    groups = group_layers([layer_kv_spec(s, block_size, dtype) for s in layers])
    spec = groups[0].spec
    assert isinstance(spec, AttentionSpec)
    layer_groups, slot_of, num_slots = layer_placement(groups, len(layers))
    num_blocks = num_blocks_for(spec, num_slots, kv_cache_memory, num_kv_blocks)
    buffer, slots, ready = allocate_kv_cache(spec, num_slots, num_blocks, device)
    return KVCacheLayout(groups, spec, layer_groups, num_blocks, buffer,
                         [slots[j] for j in slot_of], ready)
