"""Process-wide compilation counters: what was traced, split, compiled, saved, loaded.

Tests assert on deltas: `with compilation_counter.expect(num_graphs_seen=1): ...`.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_graphs_seen: int = 0  # Dynamo traces that reached the kiln backend
    num_graphs_loaded: int = 0  # traced graphs rebuilt from the cache (no Dynamo)
    num_piecewise_graphs_seen: int = 0  # pieces after the split, splitting ops included
    num_piecewise_capturable_graphs_seen: int = 0  # compiled pieces (graph-capturable)
    num_unique_graphs: int = 0  # distinct compiled pieces (identical layers count once)
    num_backend_compilations: int = 0  # (unique piece, size or range) builds requested
    num_inductor_compiles: int = 0
    num_eager_compiles: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    num_cache_repairs: int = 0  # artifacts found broken, removed and rebuilt

    def clone(self) -> CompilationCounter:
        return dataclasses.replace(self)

    def delta(self, before: CompilationCounter) -> dict[str, int]:
        return {f.name: getattr(self, f.name) - getattr(before, f.name)
                for f in dataclasses.fields(self)}

    @contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly the given amount."""
        unknown = set(deltas) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown counters: {sorted(unknown)}")
        before = self.clone()
        yield
        got = self.delta(before)
        wrong = {k: (v, got[k]) for k, v in deltas.items() if got[k] != v}
        if wrong:
            raise AssertionError("counter deltas (expected, got): " + ", ".join(
                f"{k}={e}/{g}" for k, (e, g) in wrong.items()))


compilation_counter = CompilationCounter()
