from kiln.sampling.logprobs import (Logprob, LogprobsLists, LogprobsTensors, PositionLogprobs,
                                    to_position_dicts)
from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from kiln.sampling.sampler import Sampler, SamplerOutput

__all__ = ["MAX_LOGPROBS", "Logprob", "LogprobsLists", "LogprobsTensors", "PositionLogprobs",
           "RequestOutputKind", "Sampler", "SamplerOutput", "SamplingMetadata",
           "SamplingParams", "to_position_dicts"]
