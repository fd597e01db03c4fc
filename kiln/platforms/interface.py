"""Platform: what a device is and can do. One place answers it, so the config, the
kernels, the tuning table, the compile cache and the runner agree.

A platform is a device type (`cpu`, `cuda`); `kiln.platforms.platform_for(device)` gives
the one for an engine's device, `kiln.platforms.current_platform` the one this process
would pick by default.
"""
from __future__ import annotations

from typing import ClassVar

import torch


class Platform:
    device_type: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    # Eager runs before each capture: CUDA needs one (lazy init, cuBLAS workspaces, Triton
    # autotuning must not happen inside a capture); the CPU test graph needs none.
    graph_warmups: ClassVar[int] = 0
    # Attention backends to try when none is named, best first (kiln.attention.selector).
    attention_backends: ClassVar[tuple[str, ...]] = ("torch",)

    def device_name(self, device: str | torch.device | None = None) -> str:
        """A stable name for the device: the key of the kernel tuning table and of the
        compile cache (a table or an artifact from another device never applies)."""
        raise NotImplementedError

    def fast_bf16(self) -> bool:
        """Whether bfloat16 runs faster than float32 here (dtype='auto' then downcasts
        float32 checkpoints, as vLLM does)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
