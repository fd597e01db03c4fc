"""PiecewiseBackend: one compiled piece, built for every compile size and range up front,
dispatched on the runtime token count (an exact size wins, else the containing range)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, slots=True)
class Range:
    """Inclusive token-count range; a single size when start == end."""

    start: int
    end: int

    def __contains__(self, n: int) -> bool:
        return self.start <= n <= self.end

    @property
    def is_single_size(self) -> bool:
        return self.start == self.end

    def __str__(self) -> str:
        return f"{self.start}" if self.is_single_size else f"{self.start}-{self.end}"


class PiecewiseBackend:
    def __init__(self, name: str, runnables: dict[Range, Callable[..., Any]],
                 token_position: tuple[str, int] | None, returns_tuple: bool) -> None:
        self.name = name
        self.sizes = {r.start: fn for r, fn in runnables.items() if r.is_single_size}
        self.ranges = [(r, fn) for r, fn in runnables.items() if not r.is_single_size]
        self.token_position = token_position
        self.returns_tuple = returns_tuple
        if token_position is None and len(runnables) != 1:
            raise ValueError(f"piece {name} has no dynamic input yet {len(runnables)} builds")
        self._only = next(iter(runnables.values())) if token_position is None else None

    def select(self, num_tokens: int) -> Callable[..., Any]:
        fn = self.sizes.get(num_tokens)
        if fn is not None:
            return fn
        for r, fn in self.ranges:
            if num_tokens in r:
                return fn
        built = [str(r) for r, _ in self.ranges] + [str(s) for s in self.sizes]
        raise RuntimeError(f"{num_tokens} tokens is outside every compiled size and range "
                           f"({', '.join(built)}); raise max_num_batched_tokens or add a "
                           "compile range")

    def __call__(self, *args: Any) -> Any:
        if self._only is not None:
            fn = self._only
        else:
            kind, i = self.token_position
            fn = self.select(args[i] if kind == "int" else args[i].shape[0])
        out = fn(*args)
        # A loaded Inductor artifact returns a list even for a single output.
        if isinstance(out, (list, tuple)):
            return tuple(out) if self.returns_tuple else out[0]
        return out
