"""Whether Triton can run here, without importing it.

On a CPU, Triton runs kernels only in its numpy interpreter (`TRITON_INTERPRET=1`), and the
variable must be set before Triton is first imported: `import triton` decorates its own
standard library (`tl.zeros`, `tl.max`, ...) in the mode it finds, and a compiled standard
library cannot be called from an interpreted kernel. Inductor imports Triton during any
compile, so "before" means at process start (tests/conftest.py does it on CPU-only hosts).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

_TRUE = ("1", "true", "yes", "on", "y")


def triton_installed() -> bool:
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels in its numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


# Oldest interpreter known to run kiln's kernels: 3.8 and 3.9 do; 3.6's fails on numpy 2
# ("only 0-dimensional arrays can be converted to Python scalars" in a loop bound).
MIN_INTERPRETER_VERSION = (3, 8)


def _triton_version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def interpreter_reason() -> str | None:
    """None when Triton kernels will run interpreted here, else why they will not."""
    if not interpreter_requested():
        return "on a CPU Triton runs only under TRITON_INTERPRET=1 (for tests)"
    version = _triton_version()
    if version < MIN_INTERPRETER_VERSION:
        want = ".".join(map(str, MIN_INTERPRETER_VERSION))
        return (f"Triton {'.'.join(map(str, version))}'s interpreter cannot run these "
                f"kernels; install triton>={want} for the CPU interpreter")
    tl = sys.modules.get("triton.language")
    if tl is not None and type(tl.zeros).__name__ != "InterpretedFunction":
        return ("TRITON_INTERPRET=1 was set after Triton was imported; set it before "
                "Python starts")
    return None
