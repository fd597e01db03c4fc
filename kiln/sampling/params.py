"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM names).

Every field is validated here, once, with a `ValueError` that names the field; the engine
adds the checks that need the model (token ids inside the vocabulary).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from kiln.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (and never divide)
MAX_LOGPROBS = 20  # the most top alternatives a request may ask for per position


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top alternatives per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # JSON / regex / choice / EBNF

    def __post_init__(self) -> None:
        _check_int(self, "n", low=1)
        _check_float(self, "temperature", low=0.0, hint="(0 = greedy)")
        _check_float(self, "top_p", low=0.0, high=1.0, low_open=True)
        _check_int(self, "top_k", low=-1, hint="(-1 or 0 = all tokens)")
        self.top_k = max(self.top_k, 0)
        _check_float(self, "min_p", low=0.0, high=1.0)
        _check_float(self, "repetition_penalty", low=0.0, low_open=True, hint="(1 = off)")
        _check_float(self, "presence_penalty", low=-2.0, high=2.0)
        _check_float(self, "frequency_penalty", low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int(self, "seed")
        if self.max_tokens is not None:
            _check_int(self, "max_tokens", low=1, hint="(or None: up to max_model_len)")
        _check_int(self, "min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed "
                             f"max_tokens={self.max_tokens}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(self, name, low=0, high=MAX_LOGPROBS)
        self.logit_bias = _logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind={self.output_kind!r} must be a RequestOutputKind")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict "
                             f"of its fields), got {type(self.structured_outputs).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back while streaming so a stop string is never shown in part."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n>1 request: n=1, and a distinct seed so
        seeded samples differ from each other yet reproduce run to run."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check_int(params: SamplingParams, name: str, low: int | None = None,
               high: int | None = None, hint: str = "") -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer {hint}".rstrip())
    _check_range(name, value, low, high, False, hint)


def _check_float(params: SamplingParams, name: str, low: float | None = None,
                 high: float | None = None, low_open: bool = False, hint: str = "") -> None:
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name}={value!r} must be a number {hint}".rstrip())
    setattr(params, name, float(value))
    _check_range(name, value, low, high, low_open, hint)


def _check_range(name: str, value: float, low: float | None, high: float | None,
                 low_open: bool, hint: str) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}, "
        hi = "inf)" if high is None else f"{high}]"
        where = f"in {lo}{hi}" if lo else f"<= {high}"
        raise ValueError(f"{name}={value!r} must be {where} {hint}".rstrip())


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop={stop!r} must be a string or a list of strings")
    if any(not s for s in items):
        raise ValueError("stop contains an empty string; remove it")
    return list(items)


def _token_ids(name: str, ids: list[int] | None) -> list[int]:
    ids = list(ids or [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{name}={ids!r} must be a list of non-negative token ids")
    return ids


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias={bias!r} must map token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)  # JSON object keys arrive as strings
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise ValueError(f"logit_bias[{key!r}]={value!r}: token ids must be >= 0 and "
                             "biases numbers in [-100, 100]")
        out[token] = float(value)
    return out
