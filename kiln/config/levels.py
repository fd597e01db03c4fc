"""The `-O0..-O3` table: defaults for every level-controlled field, applied only to fields
still left None, so anything a user sets explicitly wins.

| field                    | O0   | O1        | O2                 | O3                        |
|--------------------------|------|-----------|--------------------|---------------------------|
| compilation mode         | NONE | PIECEWISE | PIECEWISE          | PIECEWISE                 |
| cudagraph_mode           | NONE | PIECEWISE | FULL_AND_PIECEWISE | FULL_AND_PIECEWISE        |
| compile sizes            | -    | -         | -                  | CUDA: capture sizes <= 8  |
| compile ranges           | one range 1..max_num_batched_tokens at every level          |
| Inductor options (CUDA)  | -    | -         | -                  | max_autotune, coord. descent |
| Inductor options (CPU)   | -    | -         | -                  | cpp_wrapper               |
| compile_regions (CPU)    | -    | on        | on                 | off: cpp_wrapper          |

On a device without CUDA graphs the graph modes then lower to NONE (one info line), so on
the CPU -O1 and -O2 build the same code and share compile-cache entries. At every
compiling level a CPU host with at most two threads builds Inductor's fused kernels
single-threaded (`compiler.build.host_inductor_options`: not a level field, a host fact).
-O3 on the CPU adds Inductor's `cpp_wrapper`: the compiled graph's glue (buffer allocation
and the ~270 kernel and extern-op calls of a SmolLM2 step) runs as C++ instead of Python.
Measured on Zen 3 (AVX2, 2 threads, bf16; benchmarks/compile_levels.py): decode 1.26x -O2
at batch 1 and 1.13x with 32 requests; its cold compile takes about 1.5x as long (162 s vs
110 s for SmolLM2), warm start-up is the same.
compile_regions compiles one decoder layer and calls it for every layer
(`torch.compiler.nested_compile_region`) where the graph is one piece with native
attention, i.e. on the CPU (`compiler.build.use_regions`). SmolLM2 bf16, Zen 4 (AVX512-BF16,
2 threads): the cold compile of -O2 went from 50.7 s to 23.3 s, decode unchanged within
noise (batch 1: 1.00x, 32 requests: 0.99x, interleaved in one process). -O3 keeps the
layers unrolled: Inductor's cpp_wrapper cannot emit a region's call.
Fusion passes:
kiln has no custom FX passes yet; Inductor's own fusion runs at every compiling level.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from kiln.config.compilation import (SPLITTING_OPS, CompilationConfig, CompilationMode,
                                     CUDAGraphMode, default_capture_sizes,
                                     validate_capture_sizes)
from kiln.platforms import platform_for

logger = logging.getLogger(__name__)


class OptimizationLevel(IntEnum):
    """`-O0..-O3`: defaults for level-controlled fields, never overrides."""

    O0 = 0  # eager, no compilation, no graphs: the debugging baseline
    O1 = 1  # compiled pieces, PIECEWISE graphs
    O2 = 2  # + FULL graphs for uniform decode (the CLI default)
    O3 = 3  # + the expensive Inductor options where they pay off

# Static builds for the decode sizes that dominate serving: a size-specialised kernel beats
# the symbolic one only where the batch is tiny, and each size costs one more compile.
_O3_CUDA_STATIC_MAX = 8


@dataclass(frozen=True, slots=True)
class PerDevice:
    cpu: Any
    cuda: Any


Default = Any  # a value, a PerDevice, or a callable of (compilation, device)


def _o3_compile_sizes(c: CompilationConfig, device: str) -> list[int]:
    if device != "cuda":
        return []
    return [s for s in c.cudagraph_capture_sizes or [] if s <= _O3_CUDA_STATIC_MAX]


# compile_regions is on at every level: compiler.build.use_regions turns it off where it
# cannot apply (a split graph, CUDA; Inductor's cpp_wrapper, -O3 on the CPU), so -O3 with
# its Inductor options cleared builds -O2's code and shares its cache entries.
_COMMON: dict[str, Default] = {"compile_ranges_endpoints": [], "compile_regions": True}

LEVELS: dict[OptimizationLevel, dict[str, Default]] = {
    OptimizationLevel.O0: {"mode": CompilationMode.NONE, "cudagraph_mode": CUDAGraphMode.NONE,
                           "compile_sizes": [], "inductor_options": {}},
    OptimizationLevel.O1: {"mode": CompilationMode.PIECEWISE,
                           "cudagraph_mode": CUDAGraphMode.PIECEWISE,
                           "compile_sizes": [], "inductor_options": {}},
    OptimizationLevel.O2: {"mode": CompilationMode.PIECEWISE,
                           "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
                           "compile_sizes": [], "inductor_options": {}},
    OptimizationLevel.O3: {"mode": CompilationMode.PIECEWISE,
                           "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
                           "compile_sizes": _o3_compile_sizes,
                           "inductor_options": PerDevice(
                               cpu={"cpp_wrapper": True},
                               cuda={"max_autotune": True,
                                             "coordinate_descent_tuning": True})},
}


def _value(default: Default, c: CompilationConfig, device: str) -> Any:
    if isinstance(default, PerDevice):
        default = default.cuda if device == "cuda" else default.cpu
    if callable(default) and not isinstance(default, type):
        default = default(c, device)
    if isinstance(default, (list, dict)):
        default = type(default)(default)  # never share the table's own objects
    return default


def _set_default(c: CompilationConfig, device: str, name: str, default: Default) -> None:
    if getattr(c, name) is None:
        setattr(c, name, _value(default, c, device))


def apply_level_defaults(c: CompilationConfig, level: int, device: str, max_num_seqs: int,
                         max_num_batched_tokens: int) -> None:
    """Fill the compilation config from the level; the order matters because capture
    sizes depend on the final graph mode and O3's compile sizes on the capture sizes."""
    table = {**_COMMON, **LEVELS[OptimizationLevel(level)]}
    for name in ("mode", "cudagraph_mode", "compile_ranges_endpoints", "inductor_options",
                 "compile_regions"):
        _set_default(c, device, name, table[name])
    if c.splitting_ops is None:
        c.splitting_ops = list(SPLITTING_OPS)
    c.cudagraph_mode = _resolve_graph_mode(c, device)
    if not c.cudagraph_mode:
        c.cudagraph_capture_sizes = []
    elif c.cudagraph_capture_sizes is None:
        c.cudagraph_capture_sizes = default_capture_sizes(max_num_seqs, max_num_batched_tokens)
    else:
        c.cudagraph_capture_sizes = validate_capture_sizes(c.cudagraph_capture_sizes,
                                                           max_num_batched_tokens)
    _set_default(c, device, "compile_sizes", table["compile_sizes"])


def _resolve_graph_mode(c: CompilationConfig, device: str) -> CUDAGraphMode:
    mode = CUDAGraphMode.parse(c.cudagraph_mode)
    if c.mode == CompilationMode.NONE:
        mode = mode.without_piecewise()  # no compiled pieces to capture one by one
    platform = platform_for(device)
    if mode and not platform.supports_cuda_graphs and c.graph_backend == "auto":
        logger.info("CUDA graphs do not exist on %s: cudagraph_mode %s lowered to NONE "
                    "(compiled code is unchanged)", platform.device_type, mode)
        mode = CUDAGraphMode.NONE
    return mode
