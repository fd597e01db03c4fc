"""Default sampling parameters: what a request gets for the fields it does not set.

Order, highest first: the request's own field; `override_generation_config`; the
generation config (`auto`: the model's `generation_config.json`, or a given file; none
with `kiln`); then the caller's fallback (SamplingParams' defaults for `LLM`, the CLI's
flags' defaults, OpenAI's for the server). As in vLLM, only the keys of SAMPLING_KEYS are
read; `do_sample` is not (a file's temperature applies as written), and `max_new_tokens`
becomes the default `max_tokens`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kiln.config.generation import FILE_NAME, SAMPLING_KEYS
from kiln.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


def generation_defaults(source: str, model_dir: Path,
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams fields the generation config sets, checked (a bad value is a
    ValueError naming the file and field). `source` is a parsed `generation_config`."""
    if source == "kiln":
        fields: dict[str, Any] = {}
        path = None
    else:
        path = model_dir / FILE_NAME if source == "auto" else Path(source)
        fields = _read_fields(path) if path.is_file() else {}
    overrides = {SAMPLING_KEYS[k]: v for k, v in (override or {}).items()}
    try:
        SamplingParams(**overrides)
    except ValueError as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    fields.update(overrides)
    try:
        SamplingParams(**fields)
    except ValueError as exc:
        where = path if path is not None else "override_generation_config"
        raise ValueError(f"generation config {where}: {exc}") from None
    if fields:
        origin = "kiln's defaults" if path is None else str(path)
        logger.info("Default sampling parameters have been overridden by the generation "
                    "config (%s): %s", origin, describe(fields))
    return fields


def _read_fields(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"generation config {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation config {path}: expected a JSON object")
    return {SAMPLING_KEYS[k]: v for k, v in data.items()
            if k in SAMPLING_KEYS and v is not None}


# Defaults a constrained request (JSON schema, regex, tools...) does not take: a grammar's
# output must repeat its punctuation and keys, and a default repetition penalty fought it
# (measured: SmolLM2 with repetition_penalty 1.1 under a JSON schema wrote an integer field
# of 400 digits rather than close the object). A request may still set one explicitly.
_NOT_UNDER_GRAMMAR = ("repetition_penalty",)


def with_defaults(defaults: dict[str, Any], given: dict[str, Any],
                  constrained: bool = False) -> dict[str, Any]:
    """SamplingParams fields: `given` (what the request set; None means unset) laid over
    `defaults`. An explicit field always wins, so a greedy request stays greedy."""
    if constrained:
        defaults = {k: v for k, v in defaults.items() if k not in _NOT_UNDER_GRAMMAR}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def describe(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(fields.items()))
