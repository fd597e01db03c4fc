from kiln.sampling.metadata import SamplingMetadata
from kiln.sampling.params import SamplingParams
from kiln.sampling.sampler import Sampler

__all__ = ["Sampler", "SamplingMetadata", "SamplingParams"]
