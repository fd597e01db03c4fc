"""The attention backend interface every backend implements.

A backend declares what it can run (`supports`), how far CUDA graphs may capture it
(`cg_support`), builds its metadata from the runner's common metadata, and computes
attention for one layer while writing the new K/V through `slot_mapping`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Sequence

import torch


class AttentionCGSupport(IntEnum):
    """How much of a batch a backend lets a CUDA graph capture (higher = more)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by every attention layer.

    Tensors live on the model's device; the `*_cpu` lists mirror them on the host so a
    backend can loop over requests without a device sync. Rows past `num_actual_tokens`
    are padding: their slot is -1.
    """

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_padded_tokens] int64, -1 = skip
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The group's window (every layer of a KV-cache group shares its spec): None = full.
    sliding_window: int | None = None
    # Layer `keep_layer` (counted as the runner counts its caches) needs only the last
    # query_keep[r] query rows of request r (kiln.runner.kept_rows); a backend may
    # compute those alone and return zeros in the others, or compute every row.
    query_keep: list[int] | None = None
    keep_layer: int = -1

    def activate(self, groups: Sequence[AttentionMetadata], kv_caches: Sequence[torch.Tensor],
                 layer_groups: Sequence[int], specs: Sequence[AttentionLayerSpec]) -> None:
        """Called on group 0's metadata as a forward starts with this batch (`groups`:
        every KV-cache group's metadata; per layer its cache, group and spec); backends
        whose layers run outside Python (`native_layer_op`) install the batch here."""

    def deactivate(self) -> None:
        """Called as that forward ends, even when it raised."""


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """Static shape of one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # a query at p sees keys p - window + 1 .. p
    logits_soft_cap: float | None = None  # scores -> cap * tanh(scores / cap)


class AttentionBackend(ABC):
    """One instance per attention layer; stateless across steps."""

    name: ClassVar[str]
    cg_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # False: layers call the Python op `kiln::unified_attention`, which calls `forward`
    # (and the graph is split around it). True: layers call the backend's own native op,
    # `kiln_cpu::unified_attention`, which reads the batch that `activate` installed.
    native_layer_op: ClassVar[bool] = False

    def __init__(self, spec: AttentionLayerSpec) -> None:
        self.spec = spec

    @classmethod
    @abstractmethod
    def supports(cls, head_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
        """None when this backend can run the configuration, else the reason it cannot."""

    @classmethod
    def supports_layer(cls, spec: AttentionLayerSpec) -> str | None:
        """None when this backend honours the layer's window and softcap, else why not.
        Every kiln backend does; the hook is for backends that cannot."""
        return None

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> AttentionMetadata:
        """The metadata builder: derive this backend's per-step metadata from the runner's
        common metadata, once per step for all layers. The PyTorch backend uses it as is;
        kernel backends add their own fields (split counts, scheduler buffers)."""
        return common

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output: torch.Tensor) -> None:
        """query/output: [T, num_heads * head_size]; key/value: [T, num_kv_heads * head_size].

        Writes K/V of the first `num_actual_tokens` rows into `kv_cache` and the attention
        result into `output[:num_actual_tokens]`.
        """
