"""Unloading an adapter that requests still use: the engine's per-adapter request counts.

An unload marks the adapter at once (new requests naming it are rejected) and frees it
in the workers when its last in-flight request leaves, so a running request never loses
its adapter and its directory may be deleted right after the unload returns. Used by the
engine thread only (kiln.engine.async_engine); not thread-safe.
"""
from __future__ import annotations

from collections import Counter

from kiln.engine.llm_engine import LLMEngine
from kiln.lora.request import LoRAError, LoRARequest


class LoRAUnloads:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._users: Counter[int] = Counter()  # in-flight requests per adapter id
        self._unloaded: set[int] = set()  # rejected until registered again
        self._pending: set[int] = set()  # unloads waiting for their last request

    def check_usable(self, lora: LoRARequest | None) -> None:
        """A request naming an unloaded adapter fails alone (LoRAError, a ValueError)."""
        if lora is not None and lora.lora_int_id in self._unloaded:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} was unloaded; load it "
                            "again to use it")

    def acquire(self, lora_int_id: int | None) -> None:
        """A request using the adapter entered the engine."""
        if lora_int_id is not None:
            self._users[lora_int_id] += 1

    def release(self, lora_int_id: int | None) -> None:
        """A request using the adapter left the engine: unload it if an unload waits."""
        if lora_int_id is None:
            return
        self._users[lora_int_id] -= 1
        if self._users[lora_int_id] <= 0:
            del self._users[lora_int_id]
            if lora_int_id in self._pending:
                self._pending.discard(lora_int_id)
                self.engine.remove_lora(lora_int_id)

    def registered(self, lora_int_id: int) -> None:
        """The adapter was (re)registered: usable again, and kept loaded."""
        self._unloaded.discard(lora_int_id)
        self._pending.discard(lora_int_id)

    def unload(self, lora_int_id: int) -> bool:
        """Mark the adapter unloaded and free it now or after its last request; whether
        the engine knew it."""
        known = self.engine.loras is not None and lora_int_id in self.engine.loras.known
        self._unloaded.add(lora_int_id)
        if self._users[lora_int_id]:
            self._pending.add(lora_int_id)
        else:
            self.engine.remove_lora(lora_int_id)
        return known
