"""Sampling parameters, the sampler and logprobs."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "Logprob": "logprobs", "LogprobsLists": "logprobs", "LogprobsTensors": "logprobs",
    "MAX_LOGPROBS": "params", "PositionLogprobs": "logprobs",
    "RequestOutputKind": "params", "Sampler": "sampler", "SamplerOutput": "sampler",
    "SamplingMetadata": "metadata", "SamplingParams": "params",
    "to_position_dicts": "logprobs",
})
