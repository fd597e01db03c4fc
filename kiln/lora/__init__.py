"""Multi-LoRA serving: adapters in device slots, one batched op, no recompiles."""
from kiln.lora.config import LoRAConfig
from kiln.lora.request import LoRAError, LoRARequest

__all__ = ["LoRAConfig", "LoRAError", "LoRARequest"]
