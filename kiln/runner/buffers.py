"""Persistent host/device buffer pairs with fixed addresses (CUDA graphs replay on them)."""
from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """A host tensor (with a numpy view for cheap filling) and its device twin.

    On a CPU device the twin is the host tensor itself, so `copy_to_device` is free.
    Addresses never change: the model always reads slices of `.device`.
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu,
                                                                              device=device)

    def copy_to_device(self, n: int | None = None) -> torch.Tensor:
        if self.device is not self.cpu:
            if n is None:
                self.device.copy_(self.cpu, non_blocking=True)
            else:
                self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device if n is None else self.device[:n]
