"""Choose the attention backend: the user's pick if it can run, else the platform default.

An explicit `attention_backend` that cannot run here is a configuration error (ValueError
naming the field and the reason): silently serving with another backend would hide that
the requested kernels, and their CUDA-graph support, are not in use. Without a pick, the
device's preference list is walked and a fallback is logged in one line, so a CUDA user whose
model Triton cannot serve (say head_size 512) still gets the torch backend.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence

import torch

from kiln.attention.backend import AttentionBackend, AttentionLayerSpec
from kiln.attention.backends.cpu_paged import CpuPagedBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend
from kiln.attention.backends.triton_paged import TritonPagedBackend
from kiln.ops.tuning import load_tuning, parse_key
from kiln.platforms import device_name, platform_for

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedBackend.name: TorchPagedBackend,
    TritonPagedBackend.name: TritonPagedBackend,
    CpuPagedBackend.name: CpuPagedBackend,
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
    for candidate in platform_for(device).get_attn_backend_cls(None):
        reason = _refusal(BACKENDS[candidate], head_size, dtype, device, layers)
        if reason is None:
            if refused:
                logger.warning("attention backend %s; using %r instead", "; ".join(refused),
                               candidate)
            return BACKENDS[candidate]
        refused.append(f"{candidate!r} cannot run here ({reason})")
    raise ValueError(f"no attention backend supports head_size={head_size}, dtype={dtype} "
                     f"on {device}: {'; '.join(refused)}")


def preferred_attention_backend(head_size: int, dtype: torch.dtype, device: torch.device,
                                backends: Mapping[str, Any],
                                path: str | os.PathLike | None = None) -> str | None:
    """The backend among `backends` (name -> class) that won the most tuned attention
    shapes with this head size and dtype on this device and whose `supports()` accepts this
    configuration (ties: the first name in alphabetical order); None without tuning data.

    Backends are chosen once per engine, not per step, so the per-shape winners are
    reduced to one vote here."""
    entries = load_tuning(path).get("devices", {}).get(device_name(device), {})
    if not entries.get("attention"):
        return None
    allowed = {n for n, c in backends.items() if c.supports(head_size, dtype, device) is None}
    want = {"head_size": str(head_size), "dtype": str(dtype).removeprefix("torch.")}
    wins: dict[str, int] = {}
    for key, entry in entries.get("attention", {}).items():
        dims = parse_key(key)
        best = entry.get("best") if isinstance(entry, dict) else None
        if best in allowed and all(dims.get(k) == v for k, v in want.items()):
            wins[best] = wins.get(best, 0) + 1
    if not wins:
        return None
    choice = min(wins, key=lambda n: (-wins[n], n))
    logger.info("attention backend %r from the tuning table (fastest on %d of %d tuned "
                "shapes)", choice, wins[choice], sum(wins.values()))
    return choice
