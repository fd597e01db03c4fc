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

from typing import Sequence

from kiln.attention.backend import AttentionBackend, AttentionLayerSpec
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


def _refusal(cls: type[AttentionBackend], head_size: int, dtype: torch.dtype,
             device: torch.device, layers: Sequence[AttentionLayerSpec]) -> str | None:
    """Why `cls` cannot serve this model (shape, device, or a layer's window/softcap)."""
    reason = cls.supports(head_size, dtype, device)
    if reason is None:
        for spec in layers:
            reason = cls.supports_layer(spec)
            if reason is not None:
                break
    return reason


def select_backend(name: str | None, head_size: int, dtype: torch.dtype,
                   device: torch.device, layers: Sequence[AttentionLayerSpec] = ()
                   ) -> type[AttentionBackend]:
    """`layers`: every attention layer's spec, whose sliding window and softcap the backend
    must honour (an explicit pick that cannot is a ValueError; otherwise the next backend
    is taken, with one warning)."""
    if name is None:  # nothing named: the tuning table's pick (kiln bench kernels), if any
        from kiln.bench import preferred_attention_backend

        tuned = preferred_attention_backend(head_size, dtype, device, BACKENDS)
        if tuned is not None and tuned in BACKENDS and _refusal(
                BACKENDS[tuned], head_size, dtype, device, layers) is None:
            return BACKENDS[tuned]
    if name is not None and name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of "
                         f"{', '.join(sorted(BACKENDS))}")
    if name is not None:
        reason = _refusal(BACKENDS[name], head_size, dtype, device, layers)
        if reason is not None:
            raise ValueError(f"attention_backend={name!r} cannot run here: {reason}; choose "
                             "another backend or leave attention_backend unset to pick one "
                             "automatically")
        return BACKENDS[name]
    refused: list[str] = []
    for candidate in PREFERENCE.get(device.type, tuple(BACKENDS)):
        reason = _refusal(BACKENDS[candidate], head_size, dtype, device, layers)
        if reason is None:
            if refused:
                logger.warning("attention backend %s; using %r instead", "; ".join(refused),
                               candidate)
            return BACKENDS[candidate]
        refused.append(f"{candidate!r} cannot run here ({reason})")
    raise ValueError(f"no attention backend supports head_size={head_size}, dtype={dtype} "
                     f"on {device}: {'; '.join(refused)}")
