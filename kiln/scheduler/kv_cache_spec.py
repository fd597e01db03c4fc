"""What one layer's KV cache looks like, as frozen value objects."""
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


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Causal attention over the whole context: K and V per token per KV head."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize
