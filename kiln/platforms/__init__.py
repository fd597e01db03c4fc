"""What this device is and can do (vLLM's `vllm.platforms`).

`platform_for(device)` is the platform of an engine's device; `current_platform`, resolved
on first use, is the one this process picks by default (CUDA where it exists).
"""
from __future__ import annotations

from typing import Any

import torch

from kiln.platforms.interface import Platform

__all__ = ["Platform", "current_platform", "device_name", "platform_for"]


def platform_for(device: str | torch.device) -> Platform:
    kind = torch.device(device).type
    if kind == "cuda":
        from kiln.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from kiln.platforms.cpu import CpuPlatform

    return CpuPlatform()


def device_name(device: str | torch.device = "cpu") -> str:
    """The device's stable name: the tuning table's and the compile cache's key."""
    return platform_for(device).device_name(device)


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return platform_for("cuda" if torch.cuda.is_available() else "cpu")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
