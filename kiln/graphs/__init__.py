from kiln.graphs.dispatcher import (GraphDispatcher, default_capture_sizes,
                                    validate_capture_sizes)
from kiln.graphs.graph import CpuTestGraph, CudaGraph, global_graph_pool, weak_ref_tensors
from kiln.graphs.mode import RUNTIME_MODES, CUDAGraphMode, lower_for_attention
from kiln.graphs.wrapper import CUDAGraphWrapper, capture_phase, capturing_enabled

__all__ = ["CUDAGraphMode", "CUDAGraphWrapper", "CpuTestGraph", "CudaGraph",
           "GraphDispatcher", "RUNTIME_MODES", "capture_phase", "capturing_enabled",
           "default_capture_sizes", "global_graph_pool", "lower_for_attention",
           "validate_capture_sizes", "weak_ref_tensors"]
