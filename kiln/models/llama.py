"""Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3) in plain PyTorch.

`forward(input_ids[T], positions[T]) -> hidden[T, H]`: one flat token dimension, no batch
dimension, no masks; attention goes through the opaque op. Q/K/V and gate/up are fused
into one GEMM each; their checkpoint shards are loaded into row slices by the owning
module's `weight_loader`.
"""
from __future__ import annotations


import torch
from torch import nn

from kiln.attention import Attention
from kiln.models.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from kiln.models.model_config import ModelConfig

ShardSizes = dict[str, tuple[int, int]]  # shard id -> (row offset, rows)


class FusedLinear(Linear):
    """One GEMM for several checkpoint projections stacked by rows (q|k|v, gate|up).

    `weight_loader` copies a checkpoint shard into its row slice. It lives on the module,
    not the parameter, so it survives conversions that replace parameter objects.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        self.shards: ShardSizes = {}
        offset = 0
        for name, rows in shards.items():
            self.shards[name] = (offset, rows)
            offset += rows
        super().__init__(in_features, offset, bias=bias)

    def weight_loader(self, param: nn.Parameter, weight: torch.Tensor,
                      shard: str | None) -> None:
        if shard is None:
            param.data.copy_(weight)
            return
        offset, rows = self.shards[shard]
        if weight.shape[0] != rows:
            raise ValueError(f"shard {shard!r} has {weight.shape[0]} rows, expected {rows}")
        param.data[offset: offset + rows].copy_(weight)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = nh * hd, nkv * hd, hd
        self.qkv_proj = FusedLinear(cfg.hidden_size,
                                    {"q": nh * hd, "k": nkv * hd, "v": nkv * hd}, cfg.qkv_bias)
        self.o_proj = Linear(nh * hd, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(hd, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.attn = Attention(nh, nkv, hd, hd ** -0.5, layer_index)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, -1, self.head_dim)  # [T, heads, hd]
        k = k.reshape(T, -1, self.head_dim)  # [T, kv_heads, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size),
                        v.contiguous())
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": inter, "up": inter},
                                        bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, H]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """The model the runner calls: hidden states from `forward`, logits on request."""

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (re-run after
        any conversion that may replace parameter objects, e.g. `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_name(self, name: str) -> tuple[str, str | None] | None:
        """Map a checkpoint tensor name to (parameter name, shard id); None = skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for fragment, (fused, shard) in self.stacked_params.items():
            if f".{fragment}." in name:
                return name.replace(fragment, fused), shard
        return name, None

