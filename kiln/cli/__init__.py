"""The `kiln` command: generate, chat, serve, warmup, bench, cache."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "main": "main",
})
