"""What this device is and can do (vLLM's `vllm.platforms`).

`current_platform`, resolved on first use, is the platform this process uses by default:
a `kiln.platform_plugins` entry's class when one answers (its hardware is present), else
CUDA where it exists, else the CPU. `platform_for(device)` is the platform of an engine's
device: `current_platform` when its device type matches, else the built-in one.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from kiln.platforms.interface import Platform
from kiln.plugins import (PLATFORM_PLUGINS_GROUP, call_plugins, load_plugins_by_group,
                          resolve_qualname)

__all__ = ["Platform", "current_platform", "device_name", "platform_for"]

logger = logging.getLogger(__name__)
_current: Platform | None = None


def _builtin(kind: str) -> Platform:
    if kind == "cuda":
        from kiln.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from kiln.platforms.cpu import CpuPlatform

    return CpuPlatform()


def resolve_current_platform() -> Platform:
    """Ask every platform plugin; exactly one non-None answer wins, two are a ValueError
    naming both; none: the built-in platform of this machine."""
    answers = {name: qualname for name, qualname in
               call_plugins(load_plugins_by_group(PLATFORM_PLUGINS_GROUP)).items()
               if qualname is not None}
    if len(answers) > 1:
        named = ", ".join(f"{n!r} ({q})" for n, q in sorted(answers.items()))
        raise ValueError(f"two platform plugins are active: {named}; uninstall one or pick "
                         "one with KILN_PLUGINS=<name>")
    if not answers:
        return _builtin("cuda" if torch.cuda.is_available() else "cpu")
    (name, qualname), = answers.items()
    cls = resolve_qualname(qualname)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise ValueError(f"platform plugin {name!r} returned {qualname!r}, which is not a "
                         "kiln.platforms.Platform subclass")
    logger.info("platform %s from plugin %r", qualname, name)
    return cls()


def platform_for(device: str | torch.device) -> Platform:
    kind = torch.device(device).type
    current = _current_platform()
    return current if current.device_type == kind else _builtin(kind)


def device_name(device: str | torch.device = "cpu") -> str:
    """The device's stable name: the tuning table's and the compile cache's key."""
    return platform_for(device).device_name(device)


def _current_platform() -> Platform:
    global _current
    if _current is None:
        _current = resolve_current_platform()
    return _current


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return _current_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
