"""Parsing helpers shared by the configs: byte sizes and dict/JSON config fields."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | str, field_name: str) -> int:
    """'2GiB' / '512MB' / 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{field_name}={value!r} is not a size; write bytes like "
                             "'2GiB', '512MiB' or an integer")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{field_name}={value!r} must be positive")
    return n


def json_dict(value: dict[str, Any] | str, name: str, example: str) -> dict[str, Any]:
    """A dict given as itself or as a JSON string (a CLI flag); bad JSON or another type
    is a ValueError that names `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict such as {example}")
    return value


def config_fields(value: dict[str, Any] | str, cls: type, name: str,
                  example: str) -> dict[str, Any]:
    """The fields of a dataclass config given as a dict or a JSON string (a CLI flag):
    bad JSON, another type or an unknown field is a ValueError that names `name`."""
    value = json_dict(value, name, example)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; known: {sorted(names)}")
    return value


def positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
