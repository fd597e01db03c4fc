"""Per-step state visible to the opaque attention op, and nothing else.

Dynamo never sees what lives here: the model's forward takes only `input_ids` and
`positions`; attention reads its KV cache and metadata from the active context.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:
    from kiln.attention.backend import AttentionBackend, AttentionMetadata
    from kiln.config.compilation import CUDAGraphMode


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The key a graph is captured and replayed under (used by the graph layer)."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


@dataclass(slots=True)
class ForwardContext:
    """What one model forward needs besides its two tensor inputs.

    `attn_metadata[g]` is KV-cache group g's batch layout (one block table and slot
    mapping per group; `layer_groups[i]` is layer i's group, empty when every layer is in
    group 0). `kv_caches[i]` is layer i's cache view and `attn_backends[i]` its backend;
    `is_padding` marks rows that are padding
    (their slot is -1 and their output is never read). `cudagraph_mode` (a runtime mode:
    NONE, PIECEWISE or FULL; None means NONE) and `batch_descriptor` are the dispatcher's
    decision, which the graph wrappers obey.
    """

    attn_metadata: Sequence[AttentionMetadata] | None
    kv_caches: Sequence[torch.Tensor]
    attn_backends: Sequence[AttentionBackend]
    batch_descriptor: BatchDescriptor | None = None
    is_padding: torch.Tensor | None = None
    cudagraph_mode: CUDAGraphMode | None = None
    layer_groups: Sequence[int] = ()

    def metadata_for(self, layer_index: int) -> AttentionMetadata:
        assert self.attn_metadata is not None
        group = self.layer_groups[layer_index] if self.layer_groups else 0
        return self.attn_metadata[group]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install `ctx` for the duration of one forward; nesting is a bug and is refused."""
    global _current
    if _current is not None:
        raise RuntimeError("set_forward_context() is already active; forward contexts "
                           "do not nest (one model forward at a time)")
    _current = ctx
    md = ctx.attn_metadata
    try:
        if md is not None:
            groups = ctx.layer_groups or [0] * len(ctx.kv_caches)
            md[0].activate(md, ctx.kv_caches, groups, [b.spec for b in ctx.attn_backends])
        yield ctx
    finally:
        if md is not None:
            md[0].deactivate()
        _current = None


def get_forward_context_or_none() -> ForwardContext | None:
    return _current


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: call the model inside "
                           "kiln.attention.forward_context.set_forward_context(...) (the ModelRunner "
                           "does this); attention needs the KV cache and metadata from it")
    return _current

