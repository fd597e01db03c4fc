"""The benchmark harness behind `kiln bench` (latency, throughput, serve, compile,
kernels) and the kernel tuning table the runtime reads.

Only the tuning lookups are exported here: they are what the runtime imports at start-up,
and they stay light. The bench modes live in their own modules and load on demand.
"""
from kiln.bench.tuning import (default_tuning_path, load_tuning, lookup,
                               preferred_attention_backend)

__all__ = ["default_tuning_path", "load_tuning", "lookup", "preferred_attention_backend"]
