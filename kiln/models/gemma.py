"""Gemma 2 and Gemma 3 (text) decoders: the Llama decoder's attention and linears with
Gemma's differences, written to match transformers numerically.

- RMSNorm scales by (1 + w), in float32, and rounds after scaling; each layer has four
  norms (before and after attention, before and after the MLP).
- Embeddings are scaled by sqrt(hidden_size), rounded to the weights' dtype.
- The MLP is gelu(tanh)(gate) * up.
- Attention: the query scale is query_pre_attn_scalar^-0.5; layers alternate sliding-
  window and full attention (`layer_types`); Gemma 2 softcaps attention scores and the
  final logits (cap * tanh(x / cap)); Gemma 3 adds per-head Q/K norms and RoPE per layer
  type (a local base frequency for sliding layers).
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.models.linear import ColumnParallelLinear, RowParallelLinear
from kiln.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from kiln.models.model_config import ModelConfig
from kiln.models.vocab_parallel import VocabParallelEmbedding


class GemmaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.even(cfg.hidden_size,
                                                      {"gate": inter, "up": inter}, False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = LlamaAttention(cfg, layer_index, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is h + delta (kiln.models.layers.DecoderLayers)."""
        h = h + delta
        h = h + self.post_attention_layernorm(
            self.self_attn(positions, self.input_layernorm(h)))
        return h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class ScaledEmbedding(VocabParallelEmbedding):
    """Embeddings times sqrt(hidden), the factor rounded to the weights' dtype."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__(vocab_size, hidden)
        self.scale = hidden ** 0.5
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)
        if self.embed_scale.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        self.embed_scale.fill_(self.scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class GemmaModel(LlamaModel):
    embed_cls = ScaledEmbedding
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
