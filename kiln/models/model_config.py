"""ModelConfig: the facts about a checkpoint that kiln's model code and engine need.

Read once from the Hugging Face `config.json` (through transformers' AutoConfig, which
normalises field names across transformers versions).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.moe.config import MoEConfig, moe_config

_SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: Path
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: torch.dtype
    sliding_window: int | None
    moe: MoEConfig | None = None  # None: a dense MLP in every layer
    # Per layer "sliding_attention" / "full_attention"; empty: every layer slides when
    # `sliding_window` is set (Mistral), none otherwise.
    layer_types: tuple[str, ...] = ()
    # Gemma: tanh softcaps on attention scores and final logits, the query scale's
    # denominator, the MLP activation, and RoPE per layer type ((theta, scaling)).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    rope_by_layer_type: dict[str, tuple[float, dict | None]] | None = None
    # OLMoE: Q/K norms over the whole projection (not per head), and a clamp of Q, K, V.
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        if self.rope_by_layer_type and self.layer_types:
            return self.rope_by_layer_type[self.layer_types[layer]]
        return self.rope_theta, self.rope_scaling

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @classmethod
    def from_pretrained(cls, path: Path) -> ModelConfig:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path}/config.json has no 'architectures' entry; kiln needs "
                             "it to pick the model class (e.g. ['LlamaForCausalLM'])")
        arch = archs[0]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        by_type = _rope_by_layer_type(hf)
        theta, scaling = by_type["full_attention"] if by_type else _rope(hf)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported yet")
        return cls(
            path=path, architecture=arch, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
            qk_norm=is_qwen3 or arch in ("Gemma3ForCausalLM", "OlmoeForCausalLM"),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_eos_ids(hf), checkpoint_dtype=_dtype(hf),
            sliding_window=_sliding_window(hf), moe=moe_config(arch, hf),
            layer_types=tuple(getattr(hf, "layer_types", None) or ()),
            attn_logit_softcap=_optional_float(hf, "attn_logit_softcapping"),
            final_logit_softcap=_optional_float(hf, "final_logit_softcapping"),
            query_pre_attn_scalar=_optional_float(hf, "query_pre_attn_scalar"),
            hidden_act=_hidden_act(hf), rope_by_layer_type=by_type,
            qk_norm_per_head=arch != "OlmoeForCausalLM",
            clip_qkv=_optional_float(hf, "clip_qkv"),
        )


def _rope(hf: Any, params: dict | None = None) -> tuple[float, dict | None]:
    legacy = {} if params is not None else getattr(hf, "rope_scaling", None) or {}
    params = dict(params if params is not None else
                  getattr(hf, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: "
                         f"{', '.join(_SUPPORTED_ROPE)}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _rope_by_layer_type(hf: Any) -> dict[str, tuple[float, dict | None]] | None:
    """Gemma 3 nests RoPE parameters per layer type; None for a flat configuration."""
    params = getattr(hf, "rope_parameters", None) or {}
    if not isinstance(params.get("full_attention"), dict):
        return None
    return {kind: _rope(hf, p) for kind, p in params.items()}


def _optional_float(hf: Any, name: str) -> float | None:
    value = getattr(hf, name, None)
    return None if value is None else float(value)


_SUPPORTED_ACT = ("silu", "gelu_pytorch_tanh")


def _hidden_act(hf: Any) -> str:
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu"
    if act not in _SUPPORTED_ACT:
        raise ValueError(f"hidden activation {act!r} is not supported; supported: "
                         f"{', '.join(_SUPPORTED_ACT)}")
    return act


def _eos_ids(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _dtype(hf: Any) -> torch.dtype:
    d = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    return getattr(torch, d) if isinstance(d, str) else d


def _sliding_window(hf: Any) -> int | None:
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    window = getattr(hf, "sliding_window", None)
    return int(window) if window else None
