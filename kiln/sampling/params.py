"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM names)."""
from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (and never divide)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 is supported so far")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k={self.top_k!r} must be -1, 0 (all tokens) or positive")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer "
                             "or None (up to max_model_len)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
