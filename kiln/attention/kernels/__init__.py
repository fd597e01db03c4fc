"""Triton kernels behind the `triton` attention backend.

The public names load on first access (PEP 562), so `import kiln` never imports Triton
(0.3 s, and absent on some machines); only a selected Triton backend or a harness does.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVWriteConfig": "kv_write", "write_kv": "kv_write",
    "UnifiedAttentionConfig": "attention_kernel", "default_config": "attention_kernel",
    "unified_attention": "attention_kernel", "sweep_space": "attention_kernel",
    "interpreter_reason": "triton_runtime", "triton_installed": "triton_runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
