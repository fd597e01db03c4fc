"""Tensor parallelism on torch.distributed: the rank grid, collectives as custom ops, and
the executors that run one model over several processes."""
from kiln.distributed.ops import tp_all_gather, tp_all_reduce
from kiln.distributed.parallel_state import (GroupCoordinator, destroy_distributed,
                                             get_tp_group, get_world_group,
                                             init_distributed, initialize_model_parallel,
                                             tp_rank, tp_size)

__all__ = ["GroupCoordinator", "destroy_distributed", "get_tp_group", "get_world_group",
           "init_distributed", "initialize_model_parallel", "tp_all_gather", "tp_all_reduce",
           "tp_rank", "tp_size"]
