"""Engine configuration: every user-facing knob, validated in one place.

Misconfiguration raises `ValueError` at start-up naming the field and the fix; nothing
here uses `assert` (which `python -O` strips).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum

import torch

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


class OptimizationLevel(IntEnum):
    """`-O0..-O3`: defaults for level-controlled fields, never overrides."""

    O0 = 0  # eager, no compilation, no graphs: the debugging baseline
    O1 = 1
    O2 = 2
    O3 = 3


def parse_bytes(value: int | str, field_name: str) -> int:
    """'2GiB' / '512MB' / 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{field_name}={value!r} is not a size; write bytes like "
                             "'2GiB', '512MiB' or an integer")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{field_name}={value!r} must be positive")
    return n


def parse_dtype(value: str | torch.dtype) -> str:
    """Normalise a dtype name; 'auto' stays 'auto' until the model config is known."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in _DTYPES:
        raise ValueError(f"dtype={value!r} is not supported; use one of "
                         f"{', '.join(_DTYPES)}")
    return name


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes an engine; validated by `__post_init__`.

    Fields left `None` are filled from the model (max_model_len) or the optimization level.
    """

    model: str | None = None
    dtype: str = "auto"
    optimization_level: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    seed: int = 0
    device: str = "cpu"
    attention_backend: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        if self.optimization_level not in tuple(OptimizationLevel):
            raise ValueError(f"optimization_level={self.optimization_level!r} must be 0, 1, "
                             "2 or 3 (-O0..-O3)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _positive_int(name, getattr(self, name))
        if self.block_size % 8:
            raise ValueError(f"block_size={self.block_size} must be a multiple of 8 "
                             "(e.g. 16, the default)")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ValueError("set either kv_cache_memory or num_kv_blocks, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
            if self.num_kv_blocks < 2:
                raise ValueError("num_kv_blocks must be at least 2 (block 0 is the null block)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The requested dtype, or None for 'auto' (resolved against the checkpoint)."""
        return _DTYPES[self.dtype]


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
