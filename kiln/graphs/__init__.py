"""CUDA graphs: the dispatcher (keys and padding), the wrappers, the graph objects."""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "capture_phase": "wrapper", "capturing_enabled": "wrapper", "CpuTestGraph": "graph",
    "CudaGraph": "graph", "CUDAGraphWrapper": "wrapper", "global_graph_pool": "graph",
    "GraphDispatcher": "dispatcher", "lower_for_attention": "mode",
    "weak_ref_tensors": "graph",
})
