"""CUDAGraphMode: which parts of a forward run as captured graphs.

A runtime mode is NONE, PIECEWISE (the compiled pieces between attention ops) or FULL (the
whole forward, attention included). The two pair modes name a decode mode and a mixed
mode: uniform-decode batches (one token per request) use the first, every other batch the
second, exactly as vLLM's `(decode_mode, mixed_mode)` tuples.
"""
from __future__ import annotations

from enum import Enum

from kiln.attention.backend import AttentionCGSupport


class CUDAGraphMode(Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)  # FULL for uniform decode, eager otherwise
    FULL_AND_PIECEWISE = (2, 1)  # FULL for uniform decode, PIECEWISE otherwise

    @classmethod
    def parse(cls, value: CUDAGraphMode | str | int) -> CUDAGraphMode:
        if isinstance(value, CUDAGraphMode):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
            return cls(value)
        names = ", ".join(m.lower() for m in cls.__members__)
        raise ValueError(f"compilation.cudagraph_mode={value!r} is not a graph mode; use one "
                         f"of {names}")

    def separate_routine(self) -> bool:
        """True for the pair modes: decode and mixed batches dispatch differently."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def without_piecewise(self) -> CUDAGraphMode:
        """PIECEWISE -> NONE, FULL_AND_PIECEWISE -> FULL_DECODE_ONLY (no compiled pieces)."""
        if self is CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self is CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self

    def __bool__(self) -> bool:
        return self is not CUDAGraphMode.NONE

    def __str__(self) -> str:
        return self.name


RUNTIME_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


def lower_for_attention(mode: CUDAGraphMode, support: AttentionCGSupport,
                        piecewise_compiled: bool) -> CUDAGraphMode:
    """The strongest mode <= `mode` that the attention backends and the compiled model
    allow. FULL captures attention, so it needs the backend's support: ALWAYS for mixed
    batches, at least UNIFORM_SINGLE_TOKEN_DECODE for decode. PIECEWISE needs pieces split
    at attention (attention then runs eagerly between graphs, so any backend works)."""
    if not piecewise_compiled:
        mode = mode.without_piecewise()
    full_decode = support >= AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    if mode is CUDAGraphMode.FULL and support < AttentionCGSupport.ALWAYS:
        if full_decode:
            mode = (CUDAGraphMode.FULL_AND_PIECEWISE if piecewise_compiled
                    else CUDAGraphMode.FULL_DECODE_ONLY)
        else:
            mode = CUDAGraphMode.PIECEWISE if piecewise_compiled else CUDAGraphMode.NONE
    if mode.separate_routine() and not full_decode:
        mode = CUDAGraphMode.PIECEWISE if piecewise_compiled else CUDAGraphMode.NONE
    return mode
