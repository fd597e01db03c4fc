"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection
sampler that verifies their tokens in one target forward, and acceptance metrics.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "choose_lengths": "draft_length", "NgramProposer": "ngram",
    "SpecDecodingStats": "metrics",
})
