"""Attention cases for `kiln bench kernels`: every registered backend that can run here.

Backends come from `kiln.attention.BACKENDS` (the selector's registry), so a new backend
(the Triton one, say) is timed as soon as it is registered and its `supports()` allows.
On CUDA a backend's launch parameters are swept when it exposes them, in either of two
ways:

    @classmethod
    def tuning_configs(cls, spec, dtype, device) -> list[dict]   # e.g. BLOCK_N, num_warps
    def apply_tuning_config(self, config: dict) -> None           # on an instance

or, as the Triton backend does, a `kernel_config` attribute (None = its default) and the
configs of `kiln.attention.kernels.sweep_space(num_queries_per_kv)` (block sizes, warps,
stages). Each config is timed as its own candidate; the winner's config is written to the
tuning table next to the backend's name. Not on the CPU: the Triton interpreter ignores
warps and stages, and interpreted sweeps would take hours.

Each backend fills its own KV cache (any layout, from its `kv_cache_shape`) by running a
prefill of the context first; only the measured step (one decode token per request, or a
whole prompt) is timed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kiln.attention.backend import AttentionLayerSpec, AttentionMetadata
from kiln.attention.selector import BACKENDS
from kiln.bench.cases import Candidate, Case, Shapes
from kiln.ops.tuning import CPU_SDPA, shape_key

BLOCK_SIZE = 16


def _metadata(q_lens: list[int], seq_lens: list[int], tables: torch.Tensor,
              device: torch.device) -> AttentionMetadata:
    """Common metadata for requests whose new tokens end at their seq_len."""
    qsl, slots = [0], []
    for i, (q, n) in enumerate(zip(q_lens, seq_lens)):
        qsl.append(qsl[-1] + q)
        for pos in range(n - q, n):
            slots.append(int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(q_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=BLOCK_SIZE)


class _Step:
    """Random q/k/v for `num_tokens` rows and an output buffer."""

    def __init__(self, s: Shapes, num_tokens: int, gen: torch.Generator) -> None:
        def rnd(width: int) -> torch.Tensor:
            return torch.randn(num_tokens, width, generator=gen).to(s.device, s.dtype)

        self.q = rnd(s.num_heads * s.head_dim)
        self.k = rnd(s.num_kv_heads * s.head_dim)
        self.v = rnd(s.num_kv_heads * s.head_dim)
        self.out = torch.empty_like(self.q)


def _launch_configs(cls: Any, spec: AttentionLayerSpec, s: Shapes
                    ) -> list[tuple[dict[str, Any] | None, Any]]:
    """(JSON form, value to apply) of every launch config to time; (None, None) is the
    backend's own default."""
    configs: list[Any] = []
    if s.device.type == "cuda" and hasattr(cls, "tuning_configs"):
        configs = list(cls.tuning_configs(spec, s.dtype, s.device))
    elif s.device.type == "cuda" and hasattr(cls, "kernel_config"):
        try:
            from kiln.attention.kernels.attention_kernel import sweep_space
        except ImportError:  # a kernel_config without a sweep space: defaults only
            sweep_space = None
        if sweep_space is not None:
            configs = list(sweep_space(spec.num_heads // spec.num_kv_heads))
    as_json = [c if isinstance(c, dict) else dataclasses.asdict(c) for c in configs]
    return [(None, None), *zip(as_json, configs)]


def _apply(backend: Any, config: Any) -> None:
    if config is None:
        return
    if hasattr(backend, "apply_tuning_config"):
        backend.apply_tuning_config(config)
    else:
        backend.kernel_config = config  # an instance attribute shadows the class default


def _backend_candidates(s: Shapes, spec: AttentionLayerSpec, num_blocks: int,
                        context: tuple[AttentionMetadata, _Step] | None,
                        step_md: AttentionMetadata, step: _Step) -> list[Candidate]:
    out = []
    for cls in BACKENDS.values():
        if cls.supports(s.head_dim, s.dtype, s.device) is not None:
            continue
        for as_json, config in _launch_configs(cls, spec, s):
            try:
                run = _prepared(cls, spec, config, s, num_blocks, context, step_md, step)
            except Exception as exc:  # e.g. a launch config this GPU cannot run
                run = _failing(exc)
            out.append(Candidate(cls.name, run, as_json))
    return out


def _prepared(cls: Any, spec: AttentionLayerSpec, config: Any, s: Shapes, num_blocks: int,
              context: tuple[AttentionMetadata, _Step] | None, step_md: AttentionMetadata,
              step: _Step) -> Any:
    """A backend instance with its KV cache filled by the context; returns the timed call."""
    backend = cls(spec)
    _apply(backend, config)
    kv = torch.zeros(cls.kv_cache_shape(num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim),
                     device=s.device, dtype=s.dtype)
    if context is not None:
        md, ctx = context
        backend.forward(ctx.q, ctx.k, ctx.v, kv, cls.build_metadata(md), ctx.out)
    md = cls.build_metadata(step_md)

    def run() -> torch.Tensor:
        # Rewriting the step's own K/V each call is idempotent: same slots, same values.
        backend.forward(step.q, step.k, step.v, kv, md, step.out)
        return step.out.clone()

    return run


def _failing(exc: Exception) -> Any:
    def run() -> None:
        raise exc  # reported by the harness as this candidate's error

    return run


def attention_cases(s: Shapes, compiled: bool) -> list[Case]:
    spec = AttentionLayerSpec(s.num_heads, s.num_kv_heads, s.head_dim, s.head_dim ** -0.5)
    gen = torch.Generator().manual_seed(0)
    cases = []
    ctx = s.context_len
    per_req = -(-ctx // BLOCK_SIZE)
    for b in s.decode_batches:
        # Request i owns blocks 1 + i*per_req ... (block 0 is the null block).
        tables = torch.arange(1, 1 + b * per_req, dtype=torch.int32).view(b, per_req)
        context = (_metadata([ctx - 1] * b, [ctx - 1] * b, tables, s.device),
                   _Step(s, b * (ctx - 1), gen)) if ctx > 1 else None
        step = _Step(s, b, gen)
        md = _metadata([1] * b, [ctx] * b, tables, s.device)
        key = shape_key(phase="decode", batch=b, context=ctx, heads=s.num_heads,
                        kv_heads=s.num_kv_heads, head_size=s.head_dim, dtype=s.dtype)
        cases.append(Case("attention", key, _backend_candidates(
            s, spec, 1 + b * per_req, context, md, step)))
    for n in s.prefill_lens:
        blocks = -(-n // BLOCK_SIZE)
        tables = torch.arange(1, 1 + blocks, dtype=torch.int32).view(1, blocks)
        step = _Step(s, n, gen)
        md = _metadata([n], [n], tables, s.device)
        key = shape_key(phase="prefill", tokens=n, heads=s.num_heads,
                        kv_heads=s.num_kv_heads, head_size=s.head_dim, dtype=s.dtype)
        cands = _backend_candidates(s, spec, 1 + blocks, None, md, step)
        cases.append(Case("attention", key, cands + _cpu_sdpa(s, cands)))
    return cases


def _cpu_sdpa(s: Shapes, cands: list[Candidate]) -> list[Candidate]:
    """The cpu backend's bf16 prefill on SDPA instead of kiln's kernel (`CPU_SDPA`): the
    engine runs whichever of the two the table shows faster (cpu_paths._prefill_choice)."""
    from kiln.ops import cpu_kernels, cpu_paths

    cpu = next((c for c in cands if c.name == "cpu" and c.config is None), None)
    if cpu is None or s.dtype != torch.bfloat16 or not cpu_kernels.loaded():
        return []

    def run() -> torch.Tensor:
        with cpu_paths.prefill_sdpa():
            return cpu.run()

    return [Candidate(CPU_SDPA, run)]
