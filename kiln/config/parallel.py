"""Parallelism settings checked before the model is known: the executor backend's name
and the tensor-parallel size against this host.

Executor backends are names here (data); the name-to-class map lives with the executors
(`kiln.executor.factory`), as vLLM's `Executor.get_class`. Heads and sizes are checked
against the checkpoint at start-up (`kiln.engine.startup.check_tensor_parallel`).
"""
from __future__ import annotations

import torch

from kiln.config.utils import positive_int
from kiln.platforms.cpu import cpu_threads_per_rank

# "uni": one in-process worker; "mp": a spawned process per rank; "external_launcher":
# torchrun started every rank (kiln.executor).
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")


def check_parallel(tp: int, backend: str | None, device: str) -> None:
    positive_int("tensor_parallel_size", tp)
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r} must be one of "
                         f"{', '.join(EXECUTOR_BACKENDS)}")
    if backend == "uni" and tp > 1:
        raise ValueError(f"distributed_executor_backend='uni' runs one process but "
                         f"tensor_parallel_size={tp}: use 'mp' (the default) or "
                         "'external_launcher'")
    if backend == "external_launcher":
        return  # the ranks may span hosts: torchrun decides what runs where
    if device == "cuda" and tp > 1 and tp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp} exceeds the "
                         f"{torch.cuda.device_count()} CUDA devices here")
    cpus = cpu_threads_per_rank(1)
    if device == "cpu" and tp > 2 * cpus:
        # Each rank needs a thread; past two ranks per CPU they only time-slice.
        raise ValueError(f"tensor_parallel_size={tp} exceeds what this host allows "
                         f"(at most {2 * cpus}: two ranks per CPU, {cpus} CPUs); lower "
                         "it, or spread ranks over hosts with torchrun")
