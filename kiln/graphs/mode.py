"""Lowering a CUDA-graph mode to what the attention backends and the compiled model allow
(the modes themselves are configuration: kiln.config.compilation.CUDAGraphMode).
"""
from __future__ import annotations

from kiln.attention.backend import AttentionCGSupport
from kiln.config.compilation import CUDAGraphMode


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
