"""Whether Triton can run here, without importing it.

On a CPU, Triton runs kernels only in its numpy interpreter (`TRITON_INTERPRET=1`), and the
variable must be set before Triton is first imported: `import triton` decorates its own
standard library (`tl.zeros`, `tl.max`, ...) in the mode it finds, and a compiled standard
library cannot be called from an interpreted kernel. Inductor imports Triton during any
compile, so "before" means at process start (tests/conftest.py does it on CPU-only hosts).
"""
from __future__ import annotations

import importlib.util
import os
import sys

_TRUE = ("1", "true", "yes", "on", "y")


def triton_installed() -> bool:
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels in its numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def interpreter_reason() -> str | None:
    """None when Triton kernels will run interpreted here, else why they will not."""
    if not interpreter_requested():
        return "on a CPU Triton runs only under TRITON_INTERPRET=1 (for tests)"
    tl = sys.modules.get("triton.language")
    if tl is not None and type(tl.zeros).__name__ != "InterpretedFunction":
        return ("TRITON_INTERPRET=1 was set after Triton was imported; set it before "
                "Python starts")
    return None
