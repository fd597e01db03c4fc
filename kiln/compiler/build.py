"""Build the compiled forward for a model from an EngineConfig's compilation settings,
and the compile-cache key that names it."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.compiler.adaptors import make_adaptor
from kiln.compiler.backend import KilnBackend
from kiln.compiler.cache import CompileCache, default_cache_root
from kiln.compiler.piecewise import Range
from kiln.compiler.trace_once import DYNAMO_CONFIG, TraceOnceModel
from kiln.config.compilation import GRAPH_FIELDS, SPLITTING_OPS, CompilationConfig
from kiln.distributed.parallel_state import get_tp_group
from kiln.ops import cpu_kernels
from kiln.platforms import device_name
from kiln.version import __version__

logger = logging.getLogger(__name__)


def compile_shapes(cc: CompilationConfig, max_num_batched_tokens: int) -> list[Range]:
    """Exact sizes first (they win at dispatch), then the ranges."""
    sizes = [Range(s, s) for s in sorted(set(cc.compile_sizes or []))]
    return sizes + [Range(a, b) for a, b in cc.compile_ranges(max_num_batched_tokens)]


def source_hash(model: nn.Module) -> str:
    """Hash of the source files Dynamo traces: the model's module classes and kiln's
    attention layer (a code change must never load a stale artifact). Files are named by
    module, not path, so the same code in another checkout or venv hashes alike."""
    modules = {type(m).__module__ for m in model.modules()} | {
        "kiln.attention.layer", "kiln.ops.linear", "kiln.distributed.collectives",
        "kiln.quantization.methods", "kiln.ops.lora", "kiln.ops.pointwise"}
    h = hashlib.sha256()
    for name in sorted(modules):
        source = inspect.getsourcefile(importlib.import_module(name))
        if source:
            h.update(name.encode())
            h.update(Path(source).read_bytes())
    return h.hexdigest()[:16]


def cache_factors(model: nn.Module, cc: CompilationConfig, dtype: torch.dtype,
                  device: torch.device, shapes: list[Range], adaptor_hash: str,
                  attention_backend: str = "torch",
                  quantization: dict[str, Any] | None = None,
                  lora: dict[str, Any] | None = None,
                  weight_plan: str | None = None) -> dict[str, Any]:
    """`weight_plan`: what packing and quantization decided per layer
    (kiln.models.packing.plan_signature): the graph calls other kernels where it differs.
    `device`: the platform's device name (the tuning table's key too) plus, on a CPU, the
    capability Inductor writes vector code for (ATEN_CPU_CAPABILITY may cap it)."""
    model_config = {k: v for k, v in dataclasses.asdict(model.config).items() if k != "path"}
    compilation = {k: v for k, v in dataclasses.asdict(cc).items()
                   if k not in ("cache_dir", "use_cache", *GRAPH_FIELDS)}
    factors: dict[str, Any] = {
        "kiln_version": __version__, "model_config": model_config, "dtype": str(dtype),
        "compilation": compilation, "shapes": [str(s) for s in shapes],
        "device": _device_key(device), "torch": torch.__version__,
        "compiler": adaptor_hash, "dynamo": DYNAMO_CONFIG, "source": source_hash(model),
        "cpu_kernels": cpu_kernels.planned_signature(),
        "linear_plan": weight_plan,
        "attention_backend": attention_backend,
        "quantization": quantization or {"method": None},
        "lora": lora,  # slot shapes (None: no LoRA op in the graph)
        # Each rank compiles its own shard shapes (and collectives): its own entry.
        "tensor_parallel": [get_tp_group().rank, get_tp_group().world_size]}
    stage = getattr(model, "stage", None)
    if stage is not None and stage.size > 1:  # each stage traces other layers and ends
        factors["pipeline_stage"] = stage.cache_key()
    return factors


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return device_name(device)
    return f"{device_name(device)} {torch.backends.cpu.get_cpu_capability()}"


# Inductor parallelises a fused kernel over the token dimension when the trace's size hint
# (16 tokens) gives each thread 512+ elements, and that choice holds for every token count
# the range serves: a one-token decode step of SmolLM2 then forks and joins the OpenMP team
# about 120 times for 576 elements each. On two threads the fused kernels (norms, RoPE,
# SiLU, residual adds) gain nothing from the second thread even at a 1500-token prefill or
# 32 decoding requests, and single-threaded ones make a batch-1 step 7-13% faster (Zen 4,
# in one process; docs/levels-and-cache.md). So up to this many threads they are built
# single-threaded; kiln's linears and attention (extern ops) keep every thread. An explicit
# `cpp.threads` in inductor_options wins.
SERIAL_FUSED_KERNELS_MAX_THREADS = 2


def host_inductor_options(options: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if (device.type != "cpu" or "cpp.threads" in options
            or torch.get_num_threads() > SERIAL_FUSED_KERNELS_MAX_THREADS):
        return dict(options)
    return {**options, "cpp.threads": 1}


def use_regions(cc: CompilationConfig, native_attention: bool) -> bool:
    """Regional compilation where it can apply: the graph is not split (a split cannot cut
    inside a region), so every attention layer calls the native CPU op, which takes its
    layer as a tensor (the Python op takes an int, a constant that differs per layer),
    and no other splitting op was asked for; and Inductor writes Python glue (its
    cpp_wrapper cannot call a region: -O3 on a CPU compiles the layers unrolled)."""
    if not cc.compile_regions:
        return False
    split = any(op not in SPLITTING_OPS for op in cc.splitting_ops or [])
    cpp_wrapper = bool((cc.inductor_options or {}).get("cpp_wrapper"))
    if not native_attention or split or cpp_wrapper:
        logger.info("compile_regions: off (%s)", "Inductor's cpp_wrapper" if cpp_wrapper
                    else "the graph is split, or attention takes its layer as an int")
        return False
    return True


def compile_model(model: nn.Module, cc: CompilationConfig, dtype: torch.dtype,
                  device: torch.device, max_num_batched_tokens: int,
                  progress: bool = True, attention_backend: str = "torch",
                  quantization: dict[str, Any] | None = None,
                  lora: dict[str, Any] | None = None, weight_plan: str | None = None
                  ) -> tuple[TraceOnceModel, KilnBackend]:
    adaptor = make_adaptor(cc.backend, host_inductor_options(cc.inductor_options or {},
                                                             device))
    shapes = compile_shapes(cc, max_num_batched_tokens)
    cache = None
    if cc.use_cache:
        root = Path(cc.cache_dir).expanduser() if cc.cache_dir else default_cache_root()
        cache = CompileCache(root, cache_factors(model, cc, dtype, device, shapes,
                                                 adaptor.compute_hash(), attention_backend,
                                                 quantization, lora, weight_plan))
        logger.info("compile cache %s", cache.dir)
    backend = KilnBackend(model, adaptor, cc.splitting_ops or [], shapes, cache, progress)
    return TraceOnceModel(model.forward, backend), backend
