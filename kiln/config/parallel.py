"""Parallelism settings checked before the model is known: the executor backend's name,
the tensor- and pipeline-parallel sizes against this host, and the features pipeline
parallelism does not run with yet.

Executor backends are names here (data); the name-to-class map lives with the executors
(`kiln.executor.factory`), as vLLM's `Executor.get_class`. Heads and sizes are checked
against the checkpoint at start-up (`kiln.engine.startup.check_tensor_parallel`).
"""
from __future__ import annotations

import torch

from kiln.config.utils import positive_int
from kiln.platforms.cpu import cpu_threads_per_rank

# "uni": one in-process worker; "mp": a spawned process per rank; "ray": a Ray actor per
# rank, anywhere on a Ray cluster; "external_launcher": torchrun started every rank
# (kiln.executor).
EXECUTOR_BACKENDS = ("uni", "mp", "ray", "external_launcher")


def check_parallel(tp: int, backend: str | None, device: str, pp: int = 1) -> None:
    positive_int("tensor_parallel_size", tp)
    positive_int("pipeline_parallel_size", pp)
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend={backend!r} must be one of "
                         f"{', '.join(EXECUTOR_BACKENDS)}")
    if pp > 1 and backend not in (None, "mp", "ray"):
        raise ValueError(f"pipeline_parallel_size={pp} runs on the 'mp' or 'ray' executor "
                         f"(a process or actor per rank); distributed_executor_backend="
                         f"{backend!r} does not run pipeline stages yet: leave it unset or "
                         "use 'mp'")
    if backend == "uni" and tp > 1:
        raise ValueError(f"distributed_executor_backend='uni' runs one process but "
                         f"tensor_parallel_size={tp}: use 'mp' (the default) or "
                         "'external_launcher'")
    if backend in ("external_launcher", "ray"):
        return  # the ranks may span hosts: torchrun or Ray decides what runs where
    check_ranks(tp * pp, device, f"tensor_parallel_size={tp}" if pp == 1 else
                f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {tp * pp}")


def check_ranks(ranks: int, device: str, label: str) -> None:
    """`ranks` processes on this host: a CUDA device each, or a CPU thread each."""
    if device == "cuda" and ranks > 1 and ranks > torch.cuda.device_count():
        raise ValueError(f"{label} exceeds the "
                         f"{torch.cuda.device_count()} CUDA devices here")
    cpus = cpu_threads_per_rank(1)
    if device == "cpu" and ranks > 2 * cpus:
        # Each rank needs a thread; past two ranks per CPU they only time-slice.
        raise ValueError(f"{label} exceeds what this host allows "
                         f"(at most {2 * cpus}: two ranks per CPU, {cpus} CPUs); lower "
                         "it, or spread ranks over hosts with torchrun")


# Features that do not run across pipeline stages yet, and why (the field that turns each
# on, for the message).
PIPELINE_REFUSES = {
    "speculative_config": "drafts are proposed and verified on the last stage only, and "
                          "no test covers rolling the other stages back",
    "enable_lora": "adapter slots are installed per stage and not tested yet",
    "kv_transfer_config": "a connector saves and loads every layer from one process",
}


def check_pipeline_features(config: object) -> None:
    """Refuse, at start-up, what does not compose with pipeline parallelism yet."""
    pp = getattr(config, "pipeline_parallel_size", 1)
    if pp == 1:
        return
    for name, why in PIPELINE_REFUSES.items():
        if getattr(config, name, None):
            raise ValueError(f"{name} does not run with pipeline_parallel_size={pp} yet "
                             f"({why}); turn one of them off")
