"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection
sampler that verifies their tokens in one target forward, and acceptance metrics."""
from kiln.spec_decode.config import SpeculativeConfig, parse_speculative_config
from kiln.spec_decode.metrics import SpecDecodingStats
from kiln.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpecDecodingStats", "SpeculativeConfig",
           "parse_speculative_config"]
