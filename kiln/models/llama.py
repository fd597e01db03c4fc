"""Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3, and their mixture-of-experts
relatives Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE) in plain PyTorch.

`forward(input_ids[T], positions[T]) -> hidden[T, H]`: one flat token dimension, no batch
dimension, no masks; attention goes through the opaque op. Q/K/V and gate/up are fused
into one GEMM each; their checkpoint shards are loaded into row slices by the owning
module's `weight_loader`.

The model names its parallel layers (`kiln.models.linear`, `kiln.models.vocab_parallel`)
and sizes its attention by the heads this rank holds; the layers do the sharding, the
loading of their slices and the collectives. With one rank it is the plain model.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from kiln.attention.layer import Attention
from kiln.distributed.parallel_state import tp_size
from kiln.distributed.pipeline import pipeline_stage
from kiln.models.layers import DecoderLayers, Linear, RMSNorm, RotaryEmbedding
from kiln.models.linear import ColumnParallelLinear, RowParallelLinear, qkv_parallel_linear
from kiln.models.model_config import ModelConfig
from kiln.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from kiln.moe.layer import SparseMoeBlock, expert_checkpoint_name

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LlamaAttention(nn.Module):
    """Q/K/V, optional per-head Q/K norms (`norm_cls`), RoPE of the layer's type, paged
    attention with the layer's window and softcap, and the output projection."""

    def __init__(self, cfg: ModelConfig, layer_index: int,
                 norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        hd, tp = cfg.head_dim, tp_size()
        nh, nkv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)  # this rank's heads
        self.q_size, self.kv_size, self.head_dim = nh * hd, nkv * hd, hd
        self.qkv_proj = qkv_parallel_linear(cfg.hidden_size, cfg.num_heads,
                                            cfg.num_kv_heads, hd, cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, cfg.o_bias)
        # Per-head norms (Qwen3, Gemma 3) see [T, heads, hd]; OLMoE's see the whole
        # projection [T, heads * hd] (MoE models run on one rank: nothing is sharded).
        self.norm_per_head, self.clip_qkv = cfg.qk_norm_per_head, cfg.clip_qkv
        q_dim, k_dim = (hd, hd) if cfg.qk_norm_per_head else (nh * hd, nkv * hd)
        self.q_norm = norm_cls(q_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_cls(k_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(hd, cfg.max_position_embeddings,
                                      *cfg.layer_rope(layer_index))
        scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.attn = Attention(nh, nkv, hd, scale, layer_index, cfg.layer_window(layer_index),
                              cfg.attn_logit_softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        sizes = [self.q_size, self.kv_size, self.kv_size]
        if self.q_norm is None and self.clip_qkv is None and \
                self.qkv_proj.rope_fusable(x, self.rotary):  # RoPE in the GEMM's epilogue
            q, k, v = self.qkv_proj.with_rope(x, positions, self.rotary,
                                              self.q_size + self.kv_size).split(sizes, dim=-1)
        else:
            q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
            if self.q_norm is not None and not self.norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q = q.reshape(T, -1, self.head_dim)  # [T, heads, hd]
            k = k.reshape(T, -1, self.head_dim)  # [T, kv_heads, hd]
            if self.q_norm is not None and self.norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, inter: int | None = None) -> None:
        super().__init__()
        inter = inter or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.even(cfg.hidden_size,
                                                      {"gate": inter, "up": inter}, False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        if moe is not None and moe.is_sparse(layer_index):
            shared = moe.shared_intermediate_size
            self.mlp: nn.Module = SparseMoeBlock(cfg.hidden_size, moe,
                                                 LlamaMLP(cfg, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is h + delta (kiln.models.layers.DecoderLayers)."""
        h, x = self.input_layernorm.forward_add(h, delta)
        h, x = self.post_attention_layernorm.forward_add(h, self.self_attn(positions, x))
        return h, self.mlp(x)


class LlamaModel(nn.Module):
    """Embedding, this pipeline stage's decoder layers, final norm. Under pipeline
    parallelism only the first stage embeds and only the last normalises; a later stage
    starts from the previous stage's hidden states in `pp_in`, which the runner fills each
    step (the residual stream is that one tensor: the stack adds its last delta)."""

    embed_cls: type[nn.Module] = VocabParallelEmbedding
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.stage = stage = pipeline_stage(cfg.num_layers)
        self.embed_tokens = self.embed_cls(cfg.vocab_size, cfg.hidden_size) \
            if stage.first else None
        self.layers = DecoderLayers(self.layer_cls(cfg, i) for i in stage.layers)
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps) if stage.last else None
        # [max tokens, hidden], the runner's: a graph input of fixed address like the
        # other per-step buffers, sliced to the step's tokens.
        self.register_buffer("pp_in", None, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            h = self.embed_tokens(input_ids)  # [T, H]
        else:
            h = self.pp_in[: input_ids.shape[0]]
        h = self.layers(positions, h)
        return self.norm(h) if self.norm is not None else h


class LlamaForCausalLM(nn.Module):
    """The model the runner calls: hidden states from `forward`, logits on request."""

    model_cls: type[nn.Module] = LlamaModel

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg)
        self.stage = self.model.stage
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size) \
            if self.stage.last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (re-run after
        any conversion that may replace parameter objects, e.g. `to_empty`). A last
        pipeline stage without the embedding loads the tied tensor into lm_head."""
        if self.config.tie_word_embeddings and self.stage.first and self.stage.last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def linears_after_attention(self) -> list[list[nn.Module]]:
        """Per decoder layer, the linears that see only its attention's output rows, one
        row each (kiln.runner.kept_rows): o_proj and a dense MLP's projections. A mixture
        of experts is left out: it routes rows between experts."""
        found = []
        for layer in self.model.layers:
            mlp = layer.mlp
            dense = [] if isinstance(mlp, SparseMoeBlock) else [
                getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)]
            found.append([m for m in (layer.self_attn.o_proj, *dense)
                          if isinstance(m, Linear)])
        return found

    def checkpoint_name(self, name: str) -> tuple[str, str | None] | None:
        """Map a checkpoint tensor name to (parameter name, shard id); None = skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        name = self._stage_name(name)
        if name is None:
            return None
        if self.config.moe is not None:
            expert = expert_checkpoint_name(name)
            if expert is not None:
                return expert
            name = name.replace(".block_sparse_moe.", ".mlp.")
        for fragment, (fused, shard) in self.stacked_params.items():
            if f".{fragment}." in name:
                return name.replace(fragment, fused), shard
        return name, None

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name as this pipeline stage's parameter name (its layers count
        from 0); None for what another stage holds."""
        stage = self.stage
        if name.startswith("model.embed_tokens."):
            if stage.first:
                return name
            tied = self.config.tie_word_embeddings and stage.last
            return name.replace("model.embed_tokens.", "lm_head.") if tied else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.last else None
        match = _LAYER.match(name)
        if match is None or stage.size == 1:
            return name
        index = int(match.group(1))
        if not stage.owns_layer(index):
            return None
        return f"model.layers.{index - stage.start}.{name[match.end():]}"

