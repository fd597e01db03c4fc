"""Pipeline parallelism's batch queue (vLLM's `step_with_batch_queue`).

With pp stages the engine keeps up to pp steps in flight: while the last stage computes
step k, the first already computes step k+1. Each `step` call schedules and sends a new
step if the queue has room, and returns without waiting while it still has room (the next
call schedules again); otherwise, or when nothing more can be scheduled, it waits for the
oldest step and returns it for the engine to process. The scheduler keeps two steps in
flight disjoint for decodes: a request whose last token is still being computed has
nothing to schedule (kiln.scheduler.scheduler), so the pipeline fills with other
requests' work, as vLLM's does; with fewer requests than stages a stage idles.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

from kiln.executor.abstract import Executor
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

# (the scheduler output, what it told the stat loggers about prompts)
Scheduled = tuple[SchedulerOutput, int]
Done = tuple[SchedulerOutput, ModelRunnerOutput, int]


def tells_workers(so: SchedulerOutput) -> bool:
    """Whether a step must reach the workers: tokens to run, or requests to drop."""
    return not so.is_empty or bool(so.finished_req_ids or so.preempted_req_ids)


class BatchQueue:
    def __init__(self, executor: Executor, depth: int) -> None:
        self.executor, self.depth = executor, depth
        self._queue: deque[tuple[SchedulerOutput, Any, int]] = deque()
        self.peak = 0  # the most steps ever in flight at once (pipelining happened: > 1)

    def __len__(self) -> int:
        return len(self._queue)

    def step(self, schedule: Callable[[], Scheduled], idle: Callable[[], None]
             ) -> Done | None:
        """None: a step was sent and there is room for another before waiting."""
        if len(self._queue) < self.depth:
            so, prompt_tokens = schedule()
            if tells_workers(so):
                self._queue.append((so, self.executor.execute_async(so), prompt_tokens))
                self.peak = max(self.peak, len(self._queue))
                if len(self._queue) < self.depth and not so.is_empty:
                    return None
            elif not self._queue:
                idle()
                return so, ModelRunnerOutput([], []), prompt_tokens
        so, handle, prompt_tokens = self._queue.popleft()
        return so, handle.result(), prompt_tokens
