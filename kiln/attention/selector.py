"""Choose the attention backend: the user's pick if it can run, else the platform default.

An explicit `attention_backend` that cannot run here is a configuration error (ValueError
naming the field and the reason): silently serving with another backend would hide that
the requested kernels, and their CUDA-graph support, are not in use. Without a pick, the
device's preference list is walked and a fallback is logged in one line, so a CUDA user whose
model Triton cannot serve (say head_size 512) still gets the torch backend.
"""
from __future__ import annotations

import logging

import torch

from kiln.attention.backend import AttentionBackend
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedBackend.name: TorchPagedBackend,
    TritonPagedBackend.name: TritonPagedBackend,
    CpuPagedBackend.name: CpuPagedBackend,
}

# Automatic choice per device type, best first. The CPU prefers kiln's C++ kernels and
# falls back to torch where they cannot be built; interpreted Triton is for tests only and
# must be asked for by name.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cuda": (TritonPagedBackend.name, TorchPagedBackend.name),
    "cpu": (CpuPagedBackend.name, TorchPagedBackend.name),
}


def select_backend(name: str | None, head_size: int, dtype: torch.dtype,
                   device: torch.device) -> type[AttentionBackend]:
    if name is None:  # nothing named: the tuning table's pick (kiln bench kernels), if any
        from kiln.bench import preferred_attention_backend

        name = preferred_attention_backend(head_size, dtype, device, BACKENDS)
    if name is not None and name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of "
                         f"{', '.join(sorted(BACKENDS))}")
    if name is not None:
        reason = BACKENDS[name].supports(head_size, dtype, device)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} cannot run here: {reason}; choose "
                             "another backend or leave attention_backend unset to pick one "
                             "automatically")
        return BACKENDS[name]
    refused: list[str] = []
    for candidate in PREFERENCE.get(device.type, tuple(BACKENDS)):
        reason = BACKENDS[candidate].supports(head_size, dtype, device)
        if reason is None:
            if refused:
                logger.warning("attention backend %s; using %r instead", "; ".join(refused),
                               candidate)
            return BACKENDS[candidate]
        refused.append(f"{candidate!r} cannot run here ({reason})")
    raise ValueError(f"no attention backend supports head_size={head_size}, dtype={dtype} "
                     f"on {device}: {'; '.join(refused)}")
