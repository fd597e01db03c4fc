"""The models a server answers to: its base model and the LoRA adapters on top of it
(vLLM's `/v1/models` cards and its meaning of a request's `model` field).

Invariant: adapter ids (`lora_int_id`) are handed out once, 1, 2, ..., and never reused,
not even after an unload: the engine keys prefix-cached KV blocks by adapter id, so a
reused id could serve one adapter's cached KV to another.

Everything here runs on the event loop; the engine is never touched (the caller checks
an adapter with the engine before it commits it here).
"""
from __future__ import annotations

import itertools
import json
import time
from typing import Any

from kiln.entrypoints.openai.errors import APIError
from kiln.lora.request import LoRARequest


def parse_lora_module(value: str) -> tuple[str, str]:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON form
    `{"name": "x", "path": "/p"}` (a `base_model_name` key is accepted and ignored: kiln
    serves one base model). Returns (name, path)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON ({exc})") from None
        extra = set(obj) - {"name", "path", "base_model_name"}
        if extra or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {value!r}: the JSON form takes string keys "
                             "'name' and 'path' (and 'base_model_name'), e.g. "
                             "'{\"name\": \"sql\", \"path\": \"/adapters/sql\"}'")
        name, path = obj["name"], obj["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {value!r} must be NAME=PATH (e.g. "
                             "sql=/adapters/sql) or JSON")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-modules {value!r}: both the name and the path must be "
                         "non-empty")
    return name, path


class ServedModels:
    """The base model's name and the adapters by name. A name being loaded is reserved
    (`reserve` ... `commit` or `release`), so two concurrent loads of one name cannot
    both succeed."""

    def __init__(self, base_name: str, root: str, max_model_len: int) -> None:
        self.base_name = base_name
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.adapters: dict[str, LoRARequest] = {}
        self._reserved: set[str] = set()
        self._ids = itertools.count(1)

    def reserve(self, name: str, path: str) -> LoRARequest:
        """A new adapter under a fresh id. ValueError if the name is taken."""
        if name == self.base_name:
            raise ValueError(f"the LoRA adapter name '{name}' is the base model's name; "
                             "choose another")
        if name in self.adapters or name in self._reserved:
            raise ValueError(f"the LoRA adapter '{name}' has already been loaded; unload "
                             "it first or choose another name")
        lora = LoRARequest(name, next(self._ids), path)
        self._reserved.add(name)
        return lora

    def commit(self, lora: LoRARequest) -> None:
        self._reserved.discard(lora.lora_name)
        self.adapters[lora.lora_name] = lora

    def release(self, lora: LoRARequest) -> None:
        self._reserved.discard(lora.lora_name)

    def remove(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            loaded = self._names() or "none"
            raise ValueError(f"the LoRA adapter '{name}' cannot be found (loaded: "
                             f"{loaded})")
        return lora

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name).
        An unknown name is a 404, as in vLLM."""
        if name is None or name == self.base_name:
            return None
        lora = self.adapters.get(name)
        if lora is None:
            adapters = f" and the LoRA adapters {self._names()}" if self.adapters else ""
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{self.base_name}'{adapters}", "model", "model_not_found")
        return lora

    def cards(self) -> list[dict[str, Any]]:
        return [self._base_card()] + [self._adapter_card(a) for a in self.adapters.values()]

    def card(self, name: str) -> dict[str, Any]:
        lora = self.resolve(name)
        return self._base_card() if lora is None else self._adapter_card(lora)

    def _base_card(self) -> dict[str, Any]:
        return {"id": self.base_name, "object": "model", "created": self.created,
                "owned_by": "kiln", "root": self.root, "parent": None,
                "max_model_len": self.max_model_len}

    def _adapter_card(self, lora: LoRARequest) -> dict[str, Any]:
        return {"id": lora.lora_name, "object": "model", "created": self.created,
                "owned_by": "kiln", "root": lora.lora_path, "parent": self.base_name}

    def _names(self) -> str:
        return ", ".join(f"'{n}'" for n in self.adapters)
