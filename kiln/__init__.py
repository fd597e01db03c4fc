"""kiln: a compiler-centric LLM inference engine.

The public names load on first use (PEP 562): `import kiln.platforms` or `kiln.envs`
imports nothing else of kiln.
"""
from kiln.exports import lazy_exports
from kiln.version import __version__

__getattr__, __dir__, _names = lazy_exports(__name__, {
    "CompletionOutput": "engine.outputs", "EngineConfig": "config.engine",
    "LLM": "entrypoints.llm", "LLMEngine": "engine.llm_engine",
    "IOProcessor": "entrypoints.io_processor", "LoRARequest": "lora.request",
    "ModelRegistry": "models.registry", "RequestOutput": "engine.outputs",
    "SamplingParams": "sampling.params", "StatLoggerBase": "engine.stat_loggers",
})
__all__ = [*_names, "__version__"]
