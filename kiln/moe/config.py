"""MoEConfig: a mixture-of-experts checkpoint's routing facts, read from config.json.

Mixtral: `num_local_experts`, `intermediate_size` per expert, top-k weights renormalized.
Qwen2-MoE: `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, a shared expert of
`shared_expert_intermediate_size` behind a sigmoid gate, and dense layers where
`mlp_only_layers` or `decoder_sparse_step` say so. Qwen3-MoE: as Qwen2-MoE without the
shared expert. OLMoE: `num_experts`, `intermediate_size` per expert, `norm_topk_prob`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
                     "Qwen3MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k weights divided by their sum
    shared_intermediate_size: int = 0  # 0: no shared expert
    sparse_step: int = 1  # every sparse_step-th layer is sparse ...
    dense_layers: tuple[int, ...] = ()  # ... except these

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index not in self.dense_layers \
            and (layer_index + 1) % self.sparse_step == 0


def moe_config(arch: str, hf: Any) -> MoEConfig | None:
    """The MoE facts of `hf` (a transformers config), or None for a dense architecture."""
    if arch == "MixtralForCausalLM":
        return MoEConfig(hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size,
                         renormalize=True)
    if arch == "OlmoeForCausalLM":
        return MoEConfig(hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size,
                         renormalize=bool(getattr(hf, "norm_topk_prob", False)))
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        return MoEConfig(hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                         renormalize=bool(getattr(hf, "norm_topk_prob", False)),
                         shared_intermediate_size=shared if arch.startswith("Qwen2") else 0,
                         sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
                         dense_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()))
    return None
