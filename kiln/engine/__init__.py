"""The engine: scheduling loop, output processing, detokenizing, async serving."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "AsyncLLMEngine": "async_engine", "CompletionOutput": "outputs",
    "LLMEngine": "llm_engine", "RequestOutput": "outputs",
})
