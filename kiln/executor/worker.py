"""The worker: one rank's model runner, and the calls an executor makes on it.

Every executor drives `Worker` objects: in process (`uni`, `external_launcher`) or in a
spawned process per rank (`mp`). Their arguments are a `RunnerSpec`, picklable, so a
spawned process builds exactly what an in-process one would.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.counter import compilation_counter
from kiln.config.compilation import CompilationConfig
from kiln.config.lora import LoRAConfig
from kiln.config.quantization import QuantizationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.distributed.parallel_state import get_pp_group, get_tp_group
from kiln.models.model_config import ModelConfig
from kiln.runner.model_runner import ModelRunner
from kiln.runner.state import RunnerLimits
from kiln.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerSpec:
    model_config: ModelConfig
    dtype: torch.dtype
    device: str
    limits: RunnerLimits
    seed: int = 0
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    attention_backend: str | None = None
    compilation: CompilationConfig | None = None
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    lora: LoRAConfig | None = None
    speculative: SpeculativeConfig | None = None
    draft_model_config: ModelConfig | None = None
    kv_transfer: tuple[Any, dict] | None = None  # (KVTransferConfig, model fingerprint)


def cpu_threads_per_rank(local_ranks: int) -> int:
    """This host's CPUs (the affinity mask, not the machine) split evenly over the ranks
    that share it; at least one each."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return max(1, cpus // local_ranks)


class Worker:
    """One rank. `execute` runs a step; the other methods answer `collective_rpc`."""

    def __init__(self, spec: RunnerSpec) -> None:
        self._before = compilation_counter.clone()
        torch.manual_seed(spec.seed)  # same stream on every rank: sampling agrees
        self.runner = ModelRunner(spec.model_config, spec.dtype, torch.device(spec.device),
                                  spec.limits, kv_cache_memory=spec.kv_cache_memory,
                                  num_kv_blocks=spec.num_kv_blocks,
                                  attention_backend=spec.attention_backend,
                                  compilation=spec.compilation, progress=spec.progress,
                                  quantization=spec.quantization, lora=spec.lora,
                                  speculative=spec.speculative,
                                  draft_model_config=spec.draft_model_config,
                                  kv_transfer=spec.kv_transfer)
        self.step_s = 0.0
        self.steps = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        out = self.runner.execute(so)
        self.step_s += time.perf_counter() - start
        self.steps += 1
        return out

    def describe(self) -> dict[str, Any]:
        """What the engine needs from the runner at start-up."""
        r = self.runner
        return {"kv_spec": r.kv_spec, "kv_groups": r.kv_groups,
                "num_kv_blocks": r.num_kv_blocks,
                "attention_backend": r.attn_backend_cls.name,
                "startup_phases": dict(r.phases.seconds)}

    def flush_kv_saves(self) -> dict[str, float]:
        """Wait for the KV connector's saves in flight; their counters since the last
        step."""
        c = self.runner.kv_connector
        if c is None:
            return {}
        c.store.flush()
        return c.take_worker_stats()

    def flush_pipeline(self) -> None:
        """Wait for this stage's last hand-off to the next (before leaving)."""
        if self.runner.pipeline is not None:
            self.runner.pipeline.wait_sent()

    def close(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()

    def lora_report(self) -> dict[str, Any]:
        """Adapters in slots and in the CPU cache, and how often they were loaded."""
        m = self.runner.lora
        if m is None:
            return {}
        return {"slots": dict(m.slot_of), "cpu_cache": list(m.cpu_cache),
                "loads": m.num_loads, "slot_writes": m.num_slot_writes}

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.lora is not None and self.runner.lora.remove(lora_int_id)

    def compile_report(self) -> dict[str, Any]:
        """Compile counters since this worker started, and where its cache entry is."""
        backend = self.runner.compile_backend
        cache = backend.cache if backend is not None else None
        return {"counters": compilation_counter.delta(self._before),
                "shapes": [str(s) for s in backend.shapes] if backend else [],
                "compile_time_s": backend.compile_time_s if backend else 0.0,
                "cache_dir": str(cache.dir) if cache is not None else None,
                "tp_rank": get_tp_group().rank, "pp_rank": get_pp_group().rank,
                "pp_size": get_pp_group().world_size}

    def comm_stats(self) -> dict[str, float]:
        """Time inside all-reduces and in whole steps, for the overhead report."""
        s = get_tp_group().stats
        pp = self.runner.pipeline.stats if self.runner.pipeline is not None else {}
        return {"all_reduce_s": s["all_reduce_s"], "all_reduce_calls": s["all_reduce_calls"],
                "step_s": self.step_s, "steps": self.steps,
                **{f"pp_{k}": v for k, v in pp.items()}}
