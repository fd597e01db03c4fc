"""What users call: the `LLM` class, the OpenAI-compatible server, the engine flags."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "LLM": "llm",
})
