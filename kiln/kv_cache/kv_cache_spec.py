"""What each layer's KV cache looks like, and how layers form KV-cache groups.

A spec is a frozen value object per layer. Layers with equal specs share a group: one
block table per request, one manager (kiln.kv_cache.single_type_manager). A model with
several layer types (Gemma 2/3: sliding-window and full attention) gets one group per
spec, or several groups per spec of equal size, so that every group has the same
number of layers and all groups share one block pool: a block id then names one page
in each of `group_size` per-slot cache tensors, and layer j of every group uses slot j's
tensor (vLLM's hybrid allocator layout). The memory of a block is
`page_size_bytes * group_size`, whichever group holds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's cache, in blocks of `block_size` token slots."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer occupies."""
        raise NotImplementedError

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, when it
        is scheduled at most `max_chunk` tokens per step."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    """K and V per token per KV head."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: every token's K/V stays."""

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """Causal attention over the last `sliding_window` positions (a query at position p
    sees keys p - sliding_window + 1 .. p, as transformers masks it): blocks wholly
    before the window of the next query are freed."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1")

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        # The window before a chunk, the chunk, and one block each side for alignment.
        held = -(-(self.sliding_window - 1 + max_chunk) // self.block_size) + 1
        return min(-(-num_tokens // self.block_size), held)


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """Layers that share one spec and one block table per request. `layers[j]` uses
    cache slot j (a per-slot tensor shared with layer j of every other group)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group layer specs: one group per distinct spec when a single spec covers every
    layer; otherwise each spec's layers are cut into groups of `group_size` = the
    smallest per-spec layer count (the last group of a spec may be short, leaving its
    slot unused). Groups are ordered by first layer, so full attention, when it comes
    first, is group 0."""
    if not specs:
        raise ValueError("the model has no attention layers")
    page = {s.page_size_bytes for s in specs}
    if len(page) > 1:
        raise ValueError(f"layers have different KV page sizes {sorted(page)} (head "
                         "size, KV heads or dtype differ); kiln's hybrid KV cache needs "
                         "one page size")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, s in enumerate(specs):
        by_spec.setdefault(s, []).append(i)
    size = min(len(v) for v in by_spec.values())
    groups = [KVCacheGroupSpec(spec, tuple(layers[i:i + size]))
              for spec, layers in by_spec.items() for i in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g.layers[0])


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Cache slots: the largest group's layer count."""
    return max(len(g.layers) for g in groups)


def describe_groups(groups: list[KVCacheGroupSpec]) -> str:
    """One line per group for the start-up log."""
    out = []
    for i, g in enumerate(groups):
        kind = type(g.spec).__name__
        if isinstance(g.spec, SlidingWindowSpec):
            kind += f"(window={g.spec.sliding_window})"
        out.append(f"group {i}: {kind} layers {list(g.layers)}")
    return "; ".join(out)
