"""The executor backend's name (kiln.config.parallel.EXECUTOR_BACKENDS) to its class:
vLLM's `Executor.get_class`, kept beside the executors so the config names them as data."""
from __future__ import annotations

from kiln.executor.abstract import Executor
from kiln.executor.multiproc import MultiprocExecutor
from kiln.executor.uniproc import ExternalLauncherExecutor, InProcessExecutor
from kiln.executor.worker import RunnerSpec


def resolve_backend(backend: str | None, tp: int, pp: int = 1) -> str:
    return backend or ("mp" if tp * pp > 1 else "uni")


def runs_in_process(backend: str | None, tp: int, pp: int = 1) -> bool:
    """Whether this process holds a runner (and compiles): not under `mp` or `ray`,
    whose workers are processes (actors) of their own."""
    return resolve_backend(backend, tp, pp) not in ("mp", "ray")


def make_executor(backend: str | None, tp: int, spec: RunnerSpec, pp: int = 1) -> Executor:
    backend = resolve_backend(backend, tp, pp)
    if pp > 1 and backend not in ("mp", "ray"):  # EngineConfig refuses it first
        raise ValueError(f"pipeline_parallel_size={pp} runs on the 'mp' and 'ray' "
                         "executors only")
    if backend == "ray":  # imported only when asked for: Ray is an optional extra
        from kiln.executor.ray_executor import RayExecutor

        return RayExecutor(spec, tp, pp)
    if backend == "uni":
        if tp != 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank but "
                             f"tensor_parallel_size={tp}: use 'mp' or 'external_launcher'")
        return InProcessExecutor(spec)
    if backend == "external_launcher":
        return ExternalLauncherExecutor(spec, tp)
    return MultiprocExecutor(spec, tp, pp)
