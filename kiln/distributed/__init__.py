"""Tensor and pipeline parallelism on torch.distributed: the rank grid and its groups,
collectives as custom ops, and which layers each pipeline stage holds (the executors
that run the ranks are kiln.executor).
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "destroy_distributed": "parallel_state", "get_pp_group": "parallel_state",
    "get_tp_group": "parallel_state", "pipeline_stage": "pipeline",
    "get_world_group": "parallel_state", "GroupCoordinator": "parallel_state",
    "init_distributed": "parallel_state", "initialize_model_parallel": "parallel_state",
    "tp_all_gather": "collectives", "tp_all_reduce": "collectives",
    "tp_rank": "parallel_state", "tp_size": "parallel_state",
})
