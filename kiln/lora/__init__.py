"""Multi-LoRA serving: adapters in device slots, one batched op, no recompiles."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "LoRAError": "request", "LoRAManager": "manager", "LoRARequest": "request",
})
