"""Model code (Llama family, Gemma, MoE), configs, loaders and weight packing."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build_model": "loader", "model_class": "registry", "ModelRegistry": "registry",
    "ModelConfig": "model_config",
})
