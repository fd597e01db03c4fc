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

On a device without CUDA graphs the graph modes then lower to NONE (one info line), so on
the CPU -O1 and -O2 build the same code and share compile-cache entries. At every
compiling level a CPU host with at most two threads builds Inductor's fused kernels
single-threaded (`compiler.setup.host_inductor_options`: not a level field, a host fact).
-O3 on the CPU adds Inductor's `cpp_wrapper`: the compiled graph's glue (buffer allocation
and the ~270 kernel and extern-op calls of a SmolLM2 step) runs as C++ instead of Python.
Measured on Zen 3 (AVX2, 2 threads, bf16; benchmarks/compile_levels.py): decode 1.26x -O2
at batch 1 and 1.13x with 32 requests; its cold compile takes about 1.5x as long (162 s vs
110 s for SmolLM2), warm start-up is the same.
Fusion passes:
kiln has no custom FX passes yet; Inductor's own fusion runs at every compiling level.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.config import CompilationMode, OptimizationLevel
from kiln.graphs.dispatcher import default_capture_sizes, validate_capture_sizes
from kiln.graphs.mode import CUDAGraphMode
from kiln.platform import current_platform

if TYPE_CHECKING:
    from kiln.config import EngineConfig

logger = logging.getLogger(__name__)

# Static builds for the decode sizes that dominate serving: a size-specialised kernel beats
# the symbolic one only where the batch is tiny, and each size costs one more compile.
_O3_CUDA_STATIC_MAX = 8


@dataclass(frozen=True, slots=True)
class PerDevice:
    cpu: Any
    cuda: Any


Default = Any  # a value, a PerDevice, or a callable of the EngineConfig


def _o3_compile_sizes(config: EngineConfig) -> list[int]:
    if config.device != "cuda":
        return []
    return [s for s in config.compilation.cudagraph_capture_sizes or []
            if s <= _O3_CUDA_STATIC_MAX]


_COMMON: dict[str, Default] = {"compile_ranges_endpoints": []}

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


def _value(default: Default, config: EngineConfig) -> Any:
    if isinstance(default, PerDevice):
        default = default.cuda if config.device == "cuda" else default.cpu
    if callable(default) and not isinstance(default, type):
        default = default(config)
    if isinstance(default, (list, dict)):
        default = type(default)(default)  # never share the table's own objects
    return default


def _set_default(config: EngineConfig, name: str, default: Default) -> None:
    if getattr(config.compilation, name) is None:
        setattr(config.compilation, name, _value(default, config))


def apply_level_defaults(config: EngineConfig) -> None:
    """Fill the compilation config from the level; the order matters because capture
    sizes depend on the final graph mode and O3's compile sizes on the capture sizes."""
    c = config.compilation
    table = {**_COMMON, **LEVELS[OptimizationLevel(config.optimization_level)]}
    for name in ("mode", "cudagraph_mode", "compile_ranges_endpoints", "inductor_options"):
        _set_default(config, name, table[name])
    if c.splitting_ops is None:
        from kiln.attention.op import SPLITTING_OPS

        c.splitting_ops = list(SPLITTING_OPS)
    c.cudagraph_mode = _resolve_graph_mode(config)
    if not c.cudagraph_mode:
        c.cudagraph_capture_sizes = []
    elif c.cudagraph_capture_sizes is None:
        c.cudagraph_capture_sizes = default_capture_sizes(config.max_num_seqs,
                                                          config.max_num_batched_tokens)
    else:
        c.cudagraph_capture_sizes = validate_capture_sizes(c.cudagraph_capture_sizes,
                                                           config.max_num_batched_tokens)
    _set_default(config, "compile_sizes", table["compile_sizes"])


def _resolve_graph_mode(config: EngineConfig) -> CUDAGraphMode:
    c = config.compilation
    mode = CUDAGraphMode.parse(c.cudagraph_mode)
    if c.mode == CompilationMode.NONE:
        mode = mode.without_piecewise()  # no compiled pieces to capture one by one
    platform = current_platform(config.device)
    if mode and not platform.supports_cuda_graphs and c.graph_backend == "auto":
        logger.info("CUDA graphs do not exist on %s: cudagraph_mode %s lowered to NONE "
                    "(compiled code is unchanged)", platform.device_type, mode)
        mode = CUDAGraphMode.NONE
    return mode
