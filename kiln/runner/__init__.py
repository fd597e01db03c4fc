"""The model runner: persistent buffers, inputs, padding, logits, sampling, drafters."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "CachedRequestState": "state", "ModelRunner": "model_runner", "RunnerLimits": "state",
})
