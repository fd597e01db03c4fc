"""KVTransferStats: what the connector moved, for `get_stats()` and `/metrics`."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace


@dataclass(slots=True)
class KVTransferStats:
    lookups: int = 0  # admitted-request lookups past the local prefix cache
    query_tokens: int = 0  # prompt tokens those lookups asked for
    hit_tokens: int = 0  # of those, tokens the external source supplied
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_time_s: float = 0.0  # reading and verifying blocks
    load_failures: int = 0  # corrupt or truncated blocks (recomputed)
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_time_s: float = 0.0
    save_failures: int = 0
    blocks_evicted: int = 0  # by the size budget
    remote_waits: int = 0  # requests whose remote prefill arrived in time
    remote_timeouts: int = 0  # ... or did not (computed here instead)
    remote_wait_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def merge(self, counters: dict[str, float]) -> None:
        for name, value in counters.items():
            setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> KVTransferStats:
        return replace(self)

    def as_dict(self) -> dict[str, float]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out



class Counters:
    """Counts that a store's threads add to and the engine takes, thread-safely."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + value

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._counts = self._counts, {}
        return out
