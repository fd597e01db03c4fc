from kiln.models.loader import build_model
from kiln.models.model_config import ModelConfig
from kiln.models.registry import MODEL_REGISTRY, model_class

__all__ = ["MODEL_REGISTRY", "ModelConfig", "build_model", "model_class"]
