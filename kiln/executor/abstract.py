"""Executor: what the engine calls to run a step on its workers, wherever they live.

- `uni` and `external_launcher` (kiln.executor.uniproc): the worker is in this process.
- `mp` (kiln.executor.multiproc): one spawned process per rank; the scheduler stays in
  the engine process.
`kiln.executor.factory.make_executor` maps a backend name (kiln.config.parallel) to one.
"""
from __future__ import annotations

from typing import Any

from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput


class Executor:
    """What the engine calls. `describe` fills kv_spec (group 0's), kv_groups,
    num_kv_blocks, attention_backend and startup_phases (rank 0's runner)."""

    tp_size: int = 1
    pp_size: int = 1
    # Steps the engine may have in flight at once: one per pipeline stage (mp).
    max_concurrent_batches: int = 1
    is_driver: bool = True  # this process hands outputs to the caller

    def _describe(self, info: dict[str, Any]) -> None:
        self.kv_spec = info["kv_spec"]
        self.kv_groups = info["kv_groups"]
        self.num_kv_blocks = info["num_kv_blocks"]
        self.attention_backend = info["attention_backend"]
        self.startup_phases: dict[str, float] = info.get("startup_phases", {})  # rank 0's

    @property
    def runner(self) -> Any:
        raise AttributeError(f"the {type(self).__name__} runs the model in other processes: "
                             "use collective_rpc to reach the workers")

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def execute_async(self, so: SchedulerOutput) -> StepResult:
        """Start a step; its handle's `result()` gives the output. Executors that run
        one step at a time run it here."""
        return StepResult(self.execute(so))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; one result per rank, in rank order."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass


class StepResult:
    """A step's output, already there."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output
