"""Size and allocate the paged KV cache: one allocation, one view per cache slot.

Layers map to slots through their KV-cache group (kiln.kv_cache.kv_cache_spec): with one
group every layer has its own slot; with several, layer j of every group shares slot j,
each group addressing its own blocks of it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from kiln.attention.backend import AttentionLayerSpec
from kiln.kv_cache.kv_cache_spec import (AttentionSpec, FullAttentionSpec, KVCacheGroupSpec,
                                         SlidingWindowSpec, describe_groups, group_layers,
                                         group_size)
from kiln import envs
from kiln.runner.kv_backing import (back_kv_cache, check_fits_in_memory, lazy_zeros,
                                    start_backfill)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither size field is given


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


def allocate_kv_cache(spec: AttentionSpec, num_slots: int, num_blocks: int,
                      device: torch.device, mode: str = ""
                      ) -> tuple[torch.Tensor, list[torch.Tensor], threading.Thread | None]:
    """Returns the backing tensor, per-slot views of shape
    [2, num_blocks, block_size, num_kv_heads, head_size], and on a CPU the thread that
    backs its first blocks (`kv_backing.back_kv_cache` with `mode`: join it before anything
    writes the cache). Zeroed: stale values in a fresh block must never reach attention
    (NaN * 0 is still NaN)."""
    shape = (num_slots, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    if device.type == "cpu":
        check_fits_in_memory(torch.Size(shape).numel() * spec.dtype.itemsize)
    buffer = (lazy_zeros(shape, spec.dtype) if device.type == "cpu"
              else torch.zeros(shape, dtype=spec.dtype, device=device))
    ready = None
    if device.type == "cpu":
        ready = threading.Thread(target=back_kv_cache, args=(buffer, mode),
                                 name="kiln-kv-prefault", daemon=True)
        ready.start()
    return buffer, list(buffer.unbind(0)), ready


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
    mode: str  # KILN_KV_PREFAULT's, read once at start-up

    def start_backfill(self) -> threading.Thread | None:
        """Back the rest of a CPU cache on an idle thread (kv_backing.start_backfill):
        call once the model is compiled."""
        if self.buffer.device.type != "cpu":
            return None
        return start_backfill(self.buffer, self.mode)

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
    mode = envs.KILN_KV_PREFAULT if device.type == "cpu" else ""
    buffer, slots, ready = allocate_kv_cache(spec, num_slots, num_blocks, device, mode)
    return KVCacheLayout(groups, spec, layer_groups, num_blocks, buffer,
                         [slots[j] for j in slot_of], ready, mode)
