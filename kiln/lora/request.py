"""LoRARequest: which adapter a request runs with (vLLM's names and meaning)."""
from __future__ import annotations

from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter cannot be used: the request naming it fails alone."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_int_id` names the adapter everywhere inside the engine (slots, the CPU cache,
    the prefix-cache key); it must be positive and mean one adapter for the engine's
    lifetime. `lora_path` is a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be a "
                             "positive integer (0 means no adapter)")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")

    # vLLM's short aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
