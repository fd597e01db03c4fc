"""The CUDA platform."""
from __future__ import annotations

import torch

from kiln.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    supported_quantization = ("int8", "int8-channel", "gguf", "fp8")
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    supports_cuda_graphs = True
    graph_warmups = 1
    attention_backends = ("triton", "torch")

    def device_name(self, device: str | torch.device | None = None) -> str:
        dev = torch.device(device if device is not None else "cuda")
        return f"cuda:{torch.cuda.get_device_name(dev)}"

    def fast_bf16(self) -> bool:
        """sm80 and later."""
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
