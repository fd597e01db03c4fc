"""Whether Triton can run here, and kernels that are JIT-decorated at their first launch.

Triton decides between compiling (`JITFunction`) and interpreting (`InterpretedFunction`,
numpy on the host) when `@triton.jit` runs, reading `TRITON_INTERPRET`. Decorating at import
would freeze that choice for the whole process, so a test that sets the variable after some
other test imported kiln would get compiled kernels on CPU tensors ("0 active drivers").
`LazyKernel` decorates on launch instead, once per mode, and importing kiln never imports
Triton.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

_TRUE = ("1", "true", "yes", "on", "y")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels in its numpy interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


class LazyKernel:
    """A `@triton.jit` kernel decorated at its first launch (per interpreter mode).

    `kernel[grid](*args, **meta)` behaves like launching the decorated kernel.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._decorated: dict[bool, Any] = {}

    def jit(self) -> Any:
        mode = interpreter_enabled()
        kernel = self._decorated.get(mode)
        if kernel is None:
            import triton

            kernel = self._decorated[mode] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return self.jit()[grid]


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    return LazyKernel(fn)
