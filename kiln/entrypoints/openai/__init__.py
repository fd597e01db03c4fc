"""The OpenAI-compatible HTTP server behind `kiln serve`.

Exports are lazy: the CLI imports `server` for its arguments on every command, and that
must not pull in FastAPI and uvicorn.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ServerSettings", "build_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kiln.entrypoints.openai import app

        return getattr(app, name)
    raise AttributeError(name)
