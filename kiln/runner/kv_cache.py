"""Size and allocate the paged KV cache: one allocation, one view per layer."""
from __future__ import annotations

import torch

from kiln.scheduler.kv_cache_spec import FullAttentionSpec

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither size field is given


def num_blocks_for(spec: FullAttentionSpec, num_layers: int, kv_cache_memory: int | None,
                   num_kv_blocks: int | None) -> int:
    if num_kv_blocks is not None:
        return num_kv_blocks
    memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
    blocks = memory // (spec.page_size_bytes * num_layers)
    if blocks < 2:
        raise ValueError(f"kv_cache_memory={memory} bytes holds {blocks} blocks; one block "
                         f"of all layers needs {spec.page_size_bytes * num_layers} bytes, "
                         "raise kv_cache_memory")
    return blocks


def allocate_kv_cache(spec: FullAttentionSpec, num_layers: int, num_blocks: int,
                      device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns the backing tensor and per-layer views of shape
    [2, num_blocks, block_size, num_kv_heads, head_size]. Zeroed: stale values in a fresh
    block must never reach attention (NaN * 0 is still NaN)."""
    shape = (num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    buffer = torch.zeros(shape, dtype=spec.dtype, device=device)
    return buffer, list(buffer.unbind(0))
