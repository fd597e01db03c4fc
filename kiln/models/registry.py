"""Map a checkpoint's `architectures` entry to the class that implements it."""
from __future__ import annotations

from torch import nn

from kiln.models.gemma import GemmaForCausalLM
from kiln.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Mixtures of experts: the same decoder with kiln.moe's sparse block as the MLP.
    "MixtralForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    # Sliding-window / full-attention hybrids with Gemma's norms, softcaps and scales.
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; kiln supports "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
