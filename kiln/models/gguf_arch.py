"""What differs between the GGUF architectures kiln reads: tensor names, llama.cpp's
storage conventions, and the Hugging Face config built from the metadata.

llama.cpp's converter changes some tensors on the way in, and reading them back undoes it:

- `llama`: Q/K rows are permuted to its interleaved RoPE (un-permuted here).
- `gemma2`, `gemma3`: every `*norm.weight` is stored as 1 + w (Gemma's norm scales by
  1 + w); 1 is subtracted here. RoPE is NEOX-style: no permutation.
- `qwen2moe`, and Mixtral (a `llama` file with `expert_count`): each projection's experts
  are stacked into one 3-D tensor (`ffn_{gate,up,down}_exps`, [E, N, K]); they are split
  back per expert here.

Not in the metadata, so taken as llama.cpp takes them: Gemma's query scale is
head_dim ** -0.5 except the 27B models (46 layers for Gemma 2, 62 for Gemma 3), which use
(hidden / heads) ** -0.5; Gemma 3's local RoPE base is `rope.freq_base_swa`, else 10000,
and its layers follow `attention.sliding_window_pattern`, else 5 local : 1 global.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "attn_norm": "input_layernorm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GEMMA = {**_ATTENTION, **_MLP, "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# The stacked expert tensors, [E, N, K]: their Hugging Face names have "{}" for the
# expert index (one tensor per expert).
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MIXTRAL = {"ffn_gate_inp": "block_sparse_moe.gate",
            "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
            "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
            "ffn_down_exps": "block_sparse_moe.experts.{}.w2"}
_QWEN2MOE = {**_ATTENTION, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
             "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj",
             **{k: f"mlp.experts.{{}}.{v}" for k, v in zip(EXPERT_STACKS, ("gate_proj", "up_proj",
                                                                         "down_proj"))}}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class Meta:
    """The file's `<arch>.*` metadata and its tensor list."""

    def __init__(self, reader: gguf.GGUFReader, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensors = {t.name: t for t in reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def common(self) -> dict[str, Any]:
        """The config fields every architecture shares."""
        hidden, heads = int(self.get("embedding_length")), int(self.get("attention.head_count"))
        return dict(
            vocab_size=self.vocab_size(), hidden_size=hidden,
            intermediate_size=int(self.get("feed_forward_length", 0)),
            num_hidden_layers=int(self.get("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(self.get("attention.head_count_kv", heads)),
            head_dim=int(self.get("attention.key_length", hidden // heads)),
            max_position_embeddings=int(self.get("context_length", 2048)),
            rms_norm_eps=float(self.get("attention.layer_norm_rms_epsilon", 1e-5)),
            # llama.cpp drops output.weight when the model ties it to the embedding.
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"), dtype="float32")

    def vocab_size(self) -> int:
        # The embedding's row count is what the weights need; the token list is the fallback.
        if "token_embd.weight" in self.tensors:
            return int(self.tensors["token_embd.weight"].shape[-1])  # innermost-first
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        return len(tokens.contents()) if tokens is not None else int(self.get("vocab_size"))

    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5 keeps rope_theta and any scaling together in `rope_parameters`."""
        params: dict[str, Any] = {"rope_theta": float(self.get("rope.freq_base", 10000.0))}
        kind = self.get("rope.scaling.type", "none")
        factor = self.get("rope.scaling.factor") or self.get("rope.scale_linear")
        if kind == "none" and factor is not None and float(factor) != 1.0:
            kind = "linear"  # older files only store rope.scale_linear
        if kind == "none" or factor is None:
            return params | {"rope_type": "default"}
        if kind not in ("linear", "yarn"):
            raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
        params |= {"rope_type": kind, "factor": float(factor)}
        original = self.get("rope.scaling.original_context_length")
        if kind == "yarn" and original is not None:
            params["original_max_position_embeddings"] = int(original)
        return params

    def optional_float(self, key: str) -> float | None:
        value = self.get(key)
        return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class GGUFArch:
    name: str  # general.architecture
    block_names: Mapping[str, str]  # GGUF block tensor kind -> Hugging Face module
    config: Callable[[Meta], Any]  # the transformers config
    permute_rope: bool = False  # llama.cpp permuted Q/K rows (llama only)
    norm_shift: float = 0.0  # added to every norm weight by llama.cpp (Gemma: 1)


def _llama_config(m: Meta) -> Any:
    """Llama, or Mixtral: llama.cpp writes Mixtral as `llama` with experts."""
    from transformers import LlamaConfig, MixtralConfig  # deferred: transformers is slow

    experts = int(m.get("expert_count", 0) or 0)
    if experts:
        return MixtralConfig(architectures=["MixtralForCausalLM"], **m.common(),
                             rope_parameters=m.rope_parameters(), num_local_experts=experts,
                             num_experts_per_tok=int(m.get("expert_used_count")),
                             sliding_window=None)
    return LlamaConfig(architectures=["LlamaForCausalLM"], **m.common(),
                       rope_parameters=m.rope_parameters())


def _gemma_query_scalar(m: Meta, c: dict[str, Any], big_layers: int) -> int:
    if c["num_hidden_layers"] == big_layers:  # the 27B models
        return c["hidden_size"] // c["num_attention_heads"]
    return int(c["head_dim"])


def _gemma2_config(m: Meta) -> Any:
    from transformers import Gemma2Config

    c = m.common() | {"tie_word_embeddings": True}
    return Gemma2Config(architectures=["Gemma2ForCausalLM"], **c,
                        rope_parameters=m.rope_parameters(),
                        sliding_window=int(m.get("attention.sliding_window", 4096)),
                        attn_logit_softcapping=m.optional_float("attn_logit_softcapping"),
                        final_logit_softcapping=m.optional_float("final_logit_softcapping"),
                        query_pre_attn_scalar=_gemma_query_scalar(m, c, 46))


def _gemma3_config(m: Meta) -> Any:
    from transformers import Gemma3TextConfig

    c = m.common() | {"tie_word_embeddings": True}
    local = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base_swa", 10000.0))}
    return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **c,
                            rope_parameters={"full_attention": m.rope_parameters(),
                                             "sliding_attention": local},
                            sliding_window=int(m.get("attention.sliding_window", 4096)),
                            layer_types=_gemma3_layer_types(m, c["num_hidden_layers"]),
                            query_pre_attn_scalar=_gemma_query_scalar(m, c, 62))


def _gemma3_layer_types(m: Meta, layers: int) -> list[str]:
    """`attention.sliding_window_pattern`: a period (every n-th layer is global) or one
    bool per layer (True: sliding); absent: llama.cpp's 6."""
    pattern = m.get("attention.sliding_window_pattern", 6)
    sliding = ([bool(p) for p in pattern] if isinstance(pattern, list)
               else [(i + 1) % int(pattern) != 0 for i in range(layers)])
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _qwen2moe_config(m: Meta) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        architectures=["Qwen2MoeForCausalLM"], **m.common(),
        rope_parameters=m.rope_parameters(), num_experts=int(m.get("expert_count")),
        num_experts_per_tok=int(m.get("expert_used_count")),
        moe_intermediate_size=int(m.get("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(m.get("expert_shared_feed_forward_length", 0)),
        norm_topk_prob=bool(m.get("expert_weights_norm", False)), decoder_sparse_step=1,
        mlp_only_layers=[])


ARCHITECTURES: dict[str, GGUFArch] = {a.name: a for a in (
    GGUFArch("llama", {**_ATTENTION, **_MLP, **_MIXTRAL,
                       "ffn_norm": "post_attention_layernorm"},
             _llama_config, permute_rope=True),
    GGUFArch("gemma2", _GEMMA, _gemma2_config, norm_shift=1.0),
    GGUFArch("gemma3", {**_GEMMA, "attn_q_norm": "self_attn.q_norm",
                        "attn_k_norm": "self_attn.k_norm"},
             _gemma3_config, norm_shift=1.0),
    GGUFArch("qwen2moe", _QWEN2MOE, _qwen2moe_config),
)}


def architecture(reader: gguf.GGUFReader, path: object) -> GGUFArch:
    f = reader.get_field("general.architecture")
    name = None if f is None else f.contents()
    if name not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {name!r} is not supported; kiln reads "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


def hf_name(gguf_name: str, arch: GGUFArch = ARCHITECTURES["llama"]) -> tuple[str, str]:
    """Map a GGUF tensor name to (Hugging Face name, GGUF kind such as 'attn_q'). An
    expert stack's name has "{}" where the expert index goes (it is split later)."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in arch.block_names:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{arch.block_names[kind]}.{suffix}", kind
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in TOP_LEVEL_NAMES and suffix in ("weight", "bias"):
        return f"{TOP_LEVEL_NAMES[stem]}.{suffix}", stem
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {arch.name} GGUF file")


def unpermute_rope_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q_proj / k_proj (weights or biases).

    Hugging Face's rope pairs dimension i with i + head_dim/2 (rotate_half); llama.cpp's pairs
    2i with 2i+1. The converter therefore stores HF row [head, j, i] (j in {0, 1}, i < head_dim/2)
    at position [head, i, j]; swapping the two inner axes back restores the HF order. For k_proj
    `n_heads` is the number of key/value heads.
    """
    half = weights.shape[0] // n_heads // 2
    grouped = weights.reshape(n_heads, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)
