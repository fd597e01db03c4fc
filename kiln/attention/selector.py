"""Choose the attention backend: the user's pick if it can run, else the platform default."""
from __future__ import annotations

import logging

import torch

from kiln.attention.backend import AttentionBackend
from kiln.attention.backends.torch_paged import TorchPagedBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[AttentionBackend]] = {TorchPagedBackend.name: TorchPagedBackend}


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
        if reason is None:
            return BACKENDS[name]
        logger.warning("attention backend %r cannot run here (%s); falling back", name, reason)
    for cls in BACKENDS.values():
        if cls.supports(head_size, dtype, device) is None:
            return cls
    raise ValueError(f"no attention backend supports head_size={head_size}, dtype={dtype} "
                     f"on {device}")
