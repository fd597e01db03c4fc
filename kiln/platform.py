"""What this device can do: CUDA graphs, bf16, the attention backend to prefer.

One place answers these questions so the config, the runner and the graph layer agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Platform:
    device_type: str  # "cpu" | "cuda"
    supports_cuda_graphs: bool
    supports_bf16: bool
    default_attention_backend: str
    # Eager runs before each capture: CUDA needs one (lazy init, cuBLAS workspaces, Triton
    # autotuning must not happen inside a capture); the CPU test graph needs none.
    graph_warmups: int


def current_platform(device: str | torch.device) -> Platform:
    kind = torch.device(device).type
    if kind == "cuda":
        return Platform("cuda", True, torch.cuda.is_bf16_supported(), "torch", 1)
    return Platform("cpu", False, True, "torch", 0)
