"""Shapes of the micro-benchmarks: the default model's (SmolLM2-135M) unless overridden."""
from __future__ import annotations

import os

# KILN_BENCH_SHAPES="1,32:128:256" -> decode batches 1 and 32, prefill 128, context 256.
_SPEC = os.environ.get("KILN_BENCH_SHAPES", "1,32:128:256")


def micro_shapes():
    from kiln.bench.shapes import model_shapes

    batches, prefill, context = _SPEC.split(":")
    return model_shapes(os.environ.get("KILN_BENCH_MODEL") or None,
                        os.environ.get("KILN_BENCH_DTYPE", "float32"), "cpu",
                        [int(b) for b in batches.split(",")],
                        [int(p) for p in prefill.split(",")], int(context))
