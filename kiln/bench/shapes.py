"""The shapes `kiln bench kernels` tunes for, read from a model's config (no weights)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from kiln.bench.cases import Shapes


def model_shapes(model: str | None, dtype: str, device: str, decode_batches: list[int],
                 prefill_lens: list[int], context_len: int) -> Shapes:
    from kiln.config.engine import EngineConfig
    from kiln.engine.startup import resolve_dtype
    from kiln.models.model_config import ModelConfig
    from kiln.models.model_source import resolve_model

    for name, values in (("batch_sizes", decode_batches), ("prefill_lens", prefill_lens),
                         ("context_len", [context_len])):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"{name}={values} must be positive integers")
    config = EngineConfig(model=model, dtype=dtype, device=device)
    mc = ModelConfig.from_pretrained(resolve_model(model, progress=False))
    longest = max(context_len, *prefill_lens)
    if longest > mc.max_position_embeddings:
        raise ValueError(f"context_len/prefill_lens reach {longest} tokens but the model "
                         f"has max_position_embeddings={mc.max_position_embeddings}")
    return Shapes(hidden=mc.hidden_size, intermediate=mc.intermediate_size,
                  num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                  vocab=mc.vocab_size, eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
                  max_positions=mc.max_position_embeddings,
                  decode_batches=tuple(decode_batches), prefill_lens=tuple(prefill_lens),
                  context_len=context_len, dtype=resolve_dtype(config, mc),
                  device=torch.device(device),
                  moe=None if mc.moe is None else (mc.moe.num_experts, mc.moe.top_k,
                                                   mc.moe.intermediate_size))


def run_kernels_for_model(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.bench.kernels import OPS, run_kernels
    from kiln.ops.tuning import default_tuning_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # the packed-linear and cpu-attention candidates need them
        from kiln.compiler.cache import default_cache_root
        from kiln.ops import cpu_kernels

        cpu_kernels.ensure_loaded(default_cache_root(), progress=True)
    shapes = model_shapes(args.model, args.dtype, device, args.batch_sizes, args.prefill_lens,
                          args.context_len)
    tuning = None if args.no_write else (args.tuning_file or default_tuning_path())
    return run_kernels(shapes, args.ops or list(OPS), compiled=not args.no_compiled,
                       warmup=args.warmup, iters=args.iters, tuning_file=tuning,
                       model=args.model)
