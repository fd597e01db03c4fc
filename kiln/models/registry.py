"""`ModelRegistry` (vLLM's name): a checkpoint's `architectures` entry -> the class that
implements it. kiln's own families register here like any plugin's model.

A model class is registered as the class itself or as a lazy "package.module:Class"
string, imported on first use: registering costs nothing, and works in every process
(a `kiln.general_plugins` entry runs in the engine and in each worker, see kiln.plugins).
"""
from __future__ import annotations

import logging

from torch import nn

from kiln.plugins import load_general_plugins, resolve_qualname

logger = logging.getLogger(__name__)

_LLAMA = "kiln.models.llama:LlamaForCausalLM"
_GEMMA = "kiln.models.gemma:GemmaForCausalLM"
_BUILTIN: dict[str, str] = {
    "LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA, "Qwen3ForCausalLM": _LLAMA,
    # Mixtures of experts: the same decoder with kiln.moe's sparse block as the MLP.
    "MixtralForCausalLM": _LLAMA, "OlmoeForCausalLM": _LLAMA,
    "Qwen2MoeForCausalLM": _LLAMA, "Qwen3MoeForCausalLM": _LLAMA,
    # Sliding-window / full-attention hybrids with Gemma's norms, softcaps and scales.
    "Gemma2ForCausalLM": _GEMMA, "Gemma3ForCausalLM": _GEMMA,
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, type[nn.Module] | str] = dict(_BUILTIN)
        self._loaded: dict[str, type[nn.Module]] = {}  # lazy entries, once imported

    def register_model(self, architecture: str, model_cls: type[nn.Module] | str) -> None:
        """Serve checkpoints whose config.json names `architecture` with `model_cls`: a
        class taking a `kiln.models.model_config.ModelConfig` (kiln's decoders are the
        example), or its lazy "package.module:Class" name. Re-registering replaces."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"architecture={architecture!r} must be a non-empty string")
        if isinstance(model_cls, str):
            if ":" not in model_cls:
                raise ValueError(f"model_cls={model_cls!r}: a lazy model class is written "
                                 "'package.module:Class'")
        elif not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise ValueError(f"model_cls={model_cls!r} must be a torch.nn.Module subclass or "
                             "a 'package.module:Class' string")
        if architecture in self._models and self._models[architecture] != model_cls:
            logger.warning("model architecture %s was registered already; %s replaces it",
                           architecture, model_cls)
        self._models[architecture] = model_cls
        self._loaded.pop(architecture, None)

    def get_supported_archs(self) -> list[str]:
        load_general_plugins()
        return sorted(self._models)

    def load_model_cls(self, architecture: str) -> type[nn.Module]:
        """The class for `architecture` (imported now if registered lazily); an unknown
        one is a ValueError naming it and listing the supported ones."""
        load_general_plugins()  # plugins register before any model is resolved
        entry = self._models.get(architecture)
        if entry is None:
            raise ValueError(f"architecture {architecture!r} is not supported; kiln supports "
                             f"{', '.join(sorted(self._models))} (a plugin can add one: "
                             "docs/plugins.md)")
        if not isinstance(entry, str):
            return entry
        if architecture not in self._loaded:
            cls = resolve_qualname(entry)
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ValueError(f"architecture {architecture!r}: {entry!r} is not a "
                                 "torch.nn.Module subclass")
            self._loaded[architecture] = cls
        return self._loaded[architecture]


ModelRegistry = _ModelRegistry()


def model_class(architecture: str) -> type[nn.Module]:
    return ModelRegistry.load_model_cls(architecture)
