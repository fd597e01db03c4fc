"""Start-up phases: wall seconds per named step, for the one line that says where a
start-up's time went (the engine's ready line, `kiln generate`, `kiln warmup`)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Phases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Replace phase `name` by `parts` (measured inside it, e.g. by rank 0's runner)
        and what is left of it (starting processes, connecting ranks)."""
        total = self.seconds.pop(name, 0.0)
        self.seconds.update(parts)
        self.seconds[name] = max(0.0, total - sum(parts.values()))

    def describe(self) -> str:
        """'model files 0.0 s, kernels 0.0 s, weights 1.1 s, ...' (phases under 0.05 s
        are left out)."""
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items() if s >= 0.05)
