"""The opaque attention op `kiln::unified_attention`.

Dynamo sees one `call_function` node per layer and nothing of the metadata behind it:
the op reads the KV cache, the layer's backend and the batch layout from the forward
context. It declares its one mutation (`output`), returns nothing (custom ops may not
alias their outputs), and passes the layer as an integer index instead of a name string.
"""
from __future__ import annotations

import torch

from kiln.attention.forward_context import get_forward_context


# Registered under the name kiln.config.compilation.SPLITTING_OPS lists (the graph is split
# at every call).
@torch.library.custom_op("kiln::unified_attention", mutates_args=("output",))
def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      output: torch.Tensor, layer_index: int) -> None:
    ctx = get_forward_context()
    if ctx.attn_metadata is None:  # profiling/dummy run without a batch: nothing to attend
        return
    backend = ctx.attn_backends[layer_index]
    backend.forward(query, key, value, ctx.kv_caches[layer_index], ctx.metadata_for(layer_index),
                    output)


@unified_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
      layer_index: int) -> None:
    return None

