from kiln.compiler.cache import CompileCache, default_cache_root, verify_artifact
from kiln.compiler.counter import CompilationCounter, compilation_counter
from kiln.compiler.piecewise import PiecewiseBackend, Range
from kiln.compiler.setup import compile_model, compile_shapes
from kiln.compiler.split import split_graph
from kiln.compiler.trace_once import TraceOnceModel

__all__ = ["CompilationCounter", "CompileCache", "PiecewiseBackend", "Range",
           "TraceOnceModel", "compilation_counter", "compile_model", "compile_shapes",
           "default_cache_root", "split_graph", "verify_artifact"]
