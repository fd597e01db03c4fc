"""Configuration, one module per config (engine, compilation, levels, parallel, speculative,
kv_transfer, lora, quantization), at the bottom of the house: configs name what they
configure and never import it.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "CompilationConfig": "compilation", "CompilationMode": "compilation",
    "CUDAGraphMode": "compilation", "EngineConfig": "engine",
    "EXECUTOR_BACKENDS": "parallel", "KVTransferConfig": "kv_transfer",
    "LoRAConfig": "lora", "OptimizationLevel": "levels", "parse_bytes": "utils",
    "parse_dtype": "engine", "QuantizationConfig": "quantization",
    "SpeculativeConfig": "speculative", "SPLITTING_OPS": "compilation",
})
