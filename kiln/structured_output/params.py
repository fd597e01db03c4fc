"""StructuredOutputsParams: one constraint on a request's output (vLLM's names).

Exactly one of `json`, `json_object`, `regex`, `choice` or `grammar` is set. Validation of
the shape happens here; whether the schema, regex or grammar itself is well formed is the
backend's call (`StructuredOutputManager.validate`), still before anything is scheduled.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or a JSON string
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar and vLLM read it)
    # vLLM's switch: no free whitespace between JSON tokens (small models may otherwise
    # loop on newlines and spaces until max_tokens).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, "
                             f"regex, choice or grammar (got {given or 'none'})")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs.json_object must be true when given")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                             "non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: equal keys share one compilation."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace
