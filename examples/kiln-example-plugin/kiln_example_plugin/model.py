"""The example's model: kiln's Llama decoder under its own architecture name.

An out-of-tree model is an `nn.Module` built from a `kiln.models.model_config.ModelConfig`
that follows the same contract as kiln's decoders (the forward signature, `load_weights`,
attention through kiln's layers); reusing kiln's classes, as here, is the short way.
"""
from __future__ import annotations

from kiln.models.llama import LlamaForCausalLM


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    pass
