"""The example's stat logger: totals per step."""
from __future__ import annotations

import os
from typing import Any

from kiln import StatLoggerBase


class ExampleStatLogger(StatLoggerBase):
    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self.generation_tokens = self.prompt_tokens = self.steps = 0
        self.path = os.environ.get("KILN_EXAMPLE_STATS_FILE")

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        self.steps += 1
        self.generation_tokens += iteration_stats.num_generation_tokens
        self.prompt_tokens += iteration_stats.num_prompt_tokens
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{iteration_stats.num_generation_tokens} "
                        f"{iteration_stats.num_prompt_tokens} "
                        f"{scheduler_stats.num_running_reqs} "
                        f"{scheduler_stats.num_waiting_reqs}\n")


def stat_logger() -> type[StatLoggerBase]:
    """`kiln.stat_logger_plugins` entry: the class; the engine instantiates it."""
    return ExampleStatLogger
