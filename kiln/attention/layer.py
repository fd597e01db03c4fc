"""The attention module a model holds: shapes plus a call to the opaque op."""
from __future__ import annotations

import torch
from torch import nn

from kiln.attention import op as _op  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.attention.backend import AttentionLayerSpec


class Attention(nn.Module):
    """Causal paged attention for one layer; `layer_index` selects its KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 layer_index: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} must be a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.spec = AttentionLayerSpec(num_heads, num_kv_heads, head_size, scale,
                                       sliding_window, logits_soft_cap)
        self.layer_index = layer_index
        # The native op's copy of the index, a graph input rather than a constant, so
        # every decoder layer traces to the same code (regional compilation); read on the
        # host. The runner writes it with `native_op` (a model built on `meta` has no
        # value here yet).
        self.register_buffer("layer_id", torch.tensor(layer_index), persistent=False)
        # Set by the runner from the chosen backend before tracing (`native_layer_op`).
        self.native_op = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, heads * hd], k/v: [T, kv_heads * hd] -> [T, heads * hd]. Rows may be
        # strided (column ranges of a fused QKV output): the native op reads them in place,
        # the backends behind kiln::unified_attention get V contiguous (as they always did).
        if self.native_op:
            t, s = q.shape[0], self.spec
            out3 = q.new_empty((t, s.num_heads, s.head_size))
            torch.ops.kiln_cpu.unified_attention(
                q.view(t, s.num_heads, s.head_size), k.view(t, s.num_kv_heads, s.head_size),
                v.view(t, s.num_kv_heads, s.head_size), out3, self.layer_id)
            return out3.view(t, s.num_heads * s.head_size)
        out = torch.empty_like(q)
        torch.ops.kiln.unified_attention.default(q, k, v.contiguous(), out, self.layer_index)
        return out
