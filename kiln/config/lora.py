"""LoRAConfig: the engine's LoRA limits, fixed at start-up (they size the slot buffers,
so they are part of the compile-cache key)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    max_loras: int = 1  # device slots: distinct adapters one step may run
    max_cpu_loras: int | None = None  # adapters kept loaded behind the slots (LRU)
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is over 512; adapters "
                             "that large are better merged into the weights")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras={cpu!r} must be an integer >= max_loras "
                             f"({self.max_loras}): the CPU cache holds every adapter in a "
                             "slot")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def cache_key(self) -> dict[str, Any]:
        """What changes the compiled code: the slot buffers' shapes. The CPU cache size
        does not."""
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}
