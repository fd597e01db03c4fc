"""The OpenAI-compatible HTTP server behind `kiln serve`.

Exports are lazy: the CLI imports `server` for its arguments on every command, and that
must not pull in FastAPI and uvicorn.
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build_app": "app", "ServerSettings": "app",
})
