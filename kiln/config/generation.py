"""Where default sampling parameters come from: `generation_config` and its overrides.

`generation_config` (vLLM's field and values):
- "auto" (default): the model directory's `generation_config.json`;
- "kiln" (or vLLM's spelling "vllm"): kiln's own defaults, the file is ignored;
- a path: a folder holding a `generation_config.json`, or that file itself.

`override_generation_config` (a dict or JSON string, vLLM's field) is laid over what the
source gave; with "kiln" it is the whole of the defaults.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kiln.config.utils import json_dict

# The generation-config keys kiln applies, and the SamplingParams field each one sets.
SAMPLING_KEYS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_KILN_NAMES = ("kiln", "vllm")
FILE_NAME = "generation_config.json"


def parse_generation_config(value: str | Path) -> str:
    """'auto' | 'kiln' | an absolute path to a generation_config.json; else ValueError."""
    text = str(value)
    if text == "auto" or text in _KILN_NAMES:
        return "auto" if text == "auto" else "kiln"
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise ValueError(f"generation_config={text!r}: no {FILE_NAME} there; give 'auto' "
                         "(the model's own file), 'kiln' (kiln's defaults) or a folder "
                         f"holding a {FILE_NAME}")
    return str(path)


def parse_override(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """The override_generation_config fields, checked: known keys and numeric values."""
    if value is None:
        return {}
    value = json_dict(value, "override_generation_config", "'{\"repetition_penalty\": 1.1}'")
    unknown = sorted(set(value) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(SAMPLING_KEYS)}")
    for key, item in value.items():
        if isinstance(item, bool) or not isinstance(item, (int, float)) or \
                not math.isfinite(item):
            raise ValueError(f"override_generation_config[{key!r}]={item!r} must be a number")
    return dict(value)
