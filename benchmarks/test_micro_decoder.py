"""A compiled decoder piece vs eager: the code between two attention ops.

kiln splits the model at attention; each piece it compiles is (o_proj + residual,
post-attention norm, MLP + residual, next input norm, qkv_proj). This times that piece
with the default model's widths and random weights, eager and under torch.compile
(Inductor, dynamic token dimension, as kiln compiles it), at decode and prefill sizes.
"""
from __future__ import annotations

import pytest
import torch

from micro_common import micro_shapes


def _piece():
    from kiln.models.layers import RMSNorm
    from kiln.models.llama import LlamaMLP
    from kiln.models.model_config import ModelConfig
    from kiln.models.model_source import resolve_model

    cfg = ModelConfig.from_pretrained(resolve_model(None, progress=False))
    s = micro_shapes()
    torch.manual_seed(0)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    o_proj = torch.nn.Linear(q, s.hidden, bias=False)
    qkv_proj = torch.nn.Linear(s.hidden, q + 2 * kv, bias=False)
    post_norm, next_norm = RMSNorm(s.hidden, s.eps), RMSNorm(s.hidden, s.eps)
    mlp = LlamaMLP(cfg)
    for m in (mlp.gate_up_proj, mlp.down_proj):
        torch.nn.init.normal_(m.weight, std=0.02)

    def piece(attn_out: torch.Tensor, residual: torch.Tensor):
        h = residual + o_proj(attn_out)
        h = h + mlp(post_norm(h))
        return h, qkv_proj(next_norm(h))

    return piece, q, s.hidden


_PIECE = None


def _get():
    global _PIECE
    if _PIECE is None:
        fn, q, hidden = _piece()
        _PIECE = (fn, torch.compile(fn, dynamic=True), q, hidden)
    return _PIECE


@pytest.mark.parametrize("tokens", [1, 32, 128])
@pytest.mark.parametrize("mode", ["eager", "inductor"])
def test_decoder_piece(benchmark, mode: str, tokens: int) -> None:
    eager, compiled, q, hidden = _get()
    fn = eager if mode == "eager" else compiled
    attn_out, residual = torch.randn(tokens, q), torch.randn(tokens, hidden)
    want = eager(attn_out, residual)
    got = fn(attn_out, residual)  # compiles once (dynamic in tokens) before timing
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    benchmark.group = f"decoder piece, {tokens} tokens"
    benchmark(fn, attn_out, residual)
