"""SpeculativeConfig: which proposer drafts tokens, and how many per step (vLLM's names).

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}` drafts by prompt lookup; `{"method": "draft_model", "model": PATH,
"num_speculative_tokens": k}` drafts with a smaller model run by kiln's own runner.
Validated once here: every bad field is a `ValueError` that names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.config.utils import config_fields

METHODS = ("ngram", "draft_model")
DRAFT_LENGTHS = ("cost", "deterministic")
# Prompt lookup matches at least this many tokens by default. One-token matches hit by
# chance in free text, and each false draft costs verification work for nothing; two
# tokens drafted more of a text being copied than three did, at no cost to chat
# (Zen 4, Q4_1 SmolLM2, k = 4, in one process: grounded 1.58x -> 1.62x, chat 1.14x ->
# 1.15x; k = 6: lookup 1..5 1.75x, 2..5 1.78x). Each draft row is cheap since a verify
# step's attention and Q4 kernels share their reads across rows (docs/spec-decode.md).
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only
    prompt_lookup_max: int | None = None  # ngram only
    model: str | None = None  # draft_model only
    # ngram only: "cost" cuts each draft where its tokens stop paying for their rows
    # (step costs measured on the host, acceptance learned: draft_length.py); with
    # "deterministic" a draft's length depends on its request's own tokens alone (what
    # seeded random requests always get), so that runs repeat draft for draft.
    draft_length: str = "cost"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is unknown; use "
                             f"one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an "
                             "integer >= 1 (e.g. 4)")
        if self.method == "ngram":
            self._check_lookup()
        elif self.model is None:
            raise ValueError("speculative_config.model is required for method "
                             "'draft_model': give the draft checkpoint's path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is only for method 'draft_model'")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config.draft_length={self.draft_length!r} is "
                             f"unknown; use one of {', '.join(DRAFT_LENGTHS)}")
        if self.method != "ngram" and self.draft_length != "cost":
            raise ValueError("speculative_config.draft_length is only for method 'ngram' "
                             "(a draft model drafts num_speculative_tokens every step)")

    def _check_lookup(self) -> None:
        lo = self.prompt_lookup_min
        hi = self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name}={v!r} must be an integer >= 1")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} exceeds "
                             f"prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def uses_draft_kv(self) -> bool:
        """The proposer writes KV ahead of the target (a draft model): the scheduler then
        allocates `num_speculative_tokens` lookahead slots per request."""
        return self.method == "draft_model"

    def describe(self) -> str:
        """For the start-up log. Nothing here enters the target's compile-cache key:
        verification is a batch shape that the token-range builds already cover."""
        if self.method == "ngram":
            return (f"ngram k={self.num_speculative_tokens} lookup "
                    f"{self.prompt_lookup_min}..{self.prompt_lookup_max}, "
                    f"{self.draft_length} draft lengths")
        return f"draft_model k={self.num_speculative_tokens} ({self.model})"


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None
                             ) -> SpeculativeConfig | None:
    """A dict, a JSON string (the CLI's `--speculative-config`) or a config; None: off."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = config_fields(value, SpeculativeConfig, "speculative_config",
                          '{"method": "ngram", "num_speculative_tokens": 4}')
    if "method" not in value:
        raise ValueError("speculative_config.method is required: 'ngram' or 'draft_model'")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required (e.g. 4)")
    return SpeculativeConfig(**value)
