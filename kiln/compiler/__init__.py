"""Trace once, split around attention, compile (Inductor) per token range, cache atomically."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "compilation_counter": "counter", "CompilationCounter": "counter",
    "compile_model": "build", "compile_shapes": "build", "CompileCache": "cache",
    "default_cache_root": "cache", "PiecewiseBackend": "piecewise", "Range": "piecewise",
    "split_graph": "split", "TraceOnceModel": "trace_once", "verify_artifact": "cache",
})
