"""Lazy package faces (PEP 562): a package's `__init__` names its public names and the
module of each, and a name's module is imported on first access. So importing one module
of a package never imports the rest of it, and a face adds no import edge of its own.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"Name": "module", ...})
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`exports`: public name -> the module (relative to `package`) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__, sorted(exports)
