"""Stat loggers: plugin classes that see the engine's statistics every step.

A `kiln.stat_logger_plugins` entry returns a `StatLoggerBase` subclass; the engine that
processes outputs (`LLM`, `kiln serve`; rank 0 under torchrun) instantiates each with its
config and calls `record(scheduler_stats, iteration_stats)` after every step. A logger
that raises is logged once and dropped: a plugin's bug never stops serving.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kiln.plugins import STAT_LOGGER_PLUGINS_GROUP, call_plugins, load_plugins_by_group
from kiln.scheduler.step import SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class IterationStats:
    """What one engine step did (vLLM's names)."""

    num_generation_tokens: int = 0  # tokens sampled and kept this step, all requests
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill chunks)
    num_finished_requests: int = 0


class StatLoggerBase:
    """Subclass and return the class from a `kiln.stat_logger_plugins` entry point."""

    def __init__(self, config: Any, engine_index: int = 0) -> None:
        self.config = config  # the engine's EngineConfig
        self.engine_index = engine_index

    def record(self, scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats) -> None:
        raise NotImplementedError

    def log_engine_initialized(self) -> None:
        """Called once, when the engine is ready."""


def load_stat_loggers(config: Any, engine_index: int = 0) -> list[StatLoggerBase]:
    loggers: list[StatLoggerBase] = []
    for name, cls in call_plugins(load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP)).items():
        if not (isinstance(cls, type) and issubclass(cls, StatLoggerBase)):
            logger.error("Failed to load plugin '%s': it returned %r, not a "
                         "kiln.StatLoggerBase subclass", name, cls)
            continue
        try:
            loggers.append(cls(config, engine_index))
        except Exception:
            logger.exception("Failed to load plugin '%s'", name)
    return loggers


def log_engine_initialized(loggers: list[StatLoggerBase]) -> None:
    """Call every logger's start-up hook; one that raises is logged and dropped."""
    for stat_logger in list(loggers):
        try:
            stat_logger.log_engine_initialized()
        except Exception:
            logger.exception("stat logger %s failed; it is dropped",
                             type(stat_logger).__name__)
            loggers.remove(stat_logger)


def record_all(loggers: list[StatLoggerBase], scheduler_stats: SchedulerStats,
               iteration_stats: IterationStats) -> None:
    """Call every logger; one that raises is logged and removed from `loggers`."""
    for stat_logger in list(loggers):
        try:
            stat_logger.record(scheduler_stats, iteration_stats)
        except Exception:
            logger.exception("stat logger %s failed; it is dropped",
                             type(stat_logger).__name__)
            loggers.remove(stat_logger)


def prompt_tokens_scheduled(requests: dict[str, Any], num_scheduled: dict[str, int]) -> int:
    """Prompt tokens among a step's scheduled tokens. Progress is booked at schedule time,
    so a request's computed count already includes this step's `n`."""
    total = 0
    for rid, n in num_scheduled.items():
        request = requests[rid]
        before = request.num_computed_tokens - n
        total += max(0, min(request.num_computed_tokens, request.num_prompt_tokens) - before)
    return total


def iteration_stats(prompt_tokens: int, core_outputs: list[Any]) -> IterationStats:
    return IterationStats(sum(len(o.new_token_ids) for o in core_outputs), prompt_tokens,
                          sum(o.finish_reason is not None for o in core_outputs))
