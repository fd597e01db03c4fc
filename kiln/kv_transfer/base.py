"""The KV connector contract: a scheduler-side role that decides which blocks move, and a
worker-side role that moves them (vLLM's `KVConnectorBase_V1`, kept to what kiln needs).

Scheduler side, once per request and step:
- `get_num_new_matched_tokens(request, num_computed)`: how many prompt tokens past the
  local prefix-cache hit the external source can supply (whole blocks, never the last
  prompt token: it is always computed, so logits exist). It reads and verifies them
  *now*, so a load handed to the worker cannot fail later (a corrupt, truncated or
  evicted block is a miss here, recomputed, never a wrong token). None: "not yet", for a
  request whose KV another instance is still publishing; it is asked again next step.
- `update_state_after_alloc(request, block_ids)`: the blocks that will hold those tokens.
- `build_connector_meta(scheduled)`: this step's loads and saves, for the worker.
- `request_finished(request)`: True would mean "free its blocks later, a save still reads
  them". kiln's connectors copy a block out during the step that fills it, so they always
  answer False: a freed block is never read by a save.

Worker side, around the forward: `start_load_kv` (before it), `wait_for_layer_load`,
`save_kv_layer` for every layer and `wait_for_save` (after it). The model compiles whole,
so the per-layer hooks run between steps, not inside the graph: a load completes before
the forward starts and `wait_for_layer_load` has nothing to wait for.
"""
from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kiln.config.kv_transfer import KVTransferConfig
from kiln.kv_transfer.layout import KVLayout
from kiln.kv_transfer.stats import KVTransferStats

if TYPE_CHECKING:
    from kiln.kv_cache.block_pool import KVCacheBlock
    from kiln.request import Request

logger = logging.getLogger(__name__)
_RECENT_SAVES = 1 << 16  # hashes handed to the worker lately: never saved twice meanwhile


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class BlockStore:
    """Where blocks live outside the engine, by block hash; one block's payload is a uint8
    tensor of `layout.block_bytes` (the layer-major bytes of `layout.block_shape`)."""

    peer_dead = False  # a remote source that can no longer deliver (waits end at once)

    def contains(self, block_hash: bytes) -> bool:
        raise NotImplementedError

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The verified payload, or None (absent, corrupt, truncated: all misses)."""
        raise NotImplementedError

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        """Store blocks `payload[i]` under `hashes[i]`; may complete asynchronously."""
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until every `put` so far is visible (or has failed)."""

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call (saves and failures that happened here)."""
        return {}

    def close(self) -> None:
        self.flush()


@dataclass(slots=True)
class LoadSpec:
    block_ids: list[int]
    payloads: list[torch.Tensor]  # verified, one per block


@dataclass(slots=True)
class KVConnectorMetadata:
    """Scheduler -> worker, once per step."""

    loads: dict[str, LoadSpec] = field(default_factory=dict)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)

    def drop_saves(self, block_ids: set[int]) -> None:
        """Save none of these blocks (their KV is wrong: an adapter failed to load)."""
        kept = [(h, b) for h, b in zip(self.save_hashes, self.save_block_ids)
                if b not in block_ids]
        self.save_hashes, self.save_block_ids = [h for h, _ in kept], [b for _, b in kept]


class KVConnector:
    """A connector over a `BlockStore`; subclasses say which store each role uses."""

    name = "base"
    # A block handed to a save is not saved again while remembered (a tier keeps it).
    # A push transport sends every request's blocks (its peer may have evicted them),
    # deduplicating within a step only.
    remember_saves = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 layout: KVLayout) -> None:
        self.config, self.role, self.layout = config, role, layout
        self.store = self.make_store()
        self.stats = KVTransferStats()
        self._pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # looked up, unloaded
        self._loads: dict[str, LoadSpec] = {}  # allocated this step
        self._saved_upto: dict[str, int] = {}  # blocks of each request handed to saves
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._remote_first_seen: dict[str, float] = {}
        self._remote_done: set[str] = set()
        # Worker side: this step's blocks to save, copied out layer by layer.
        self._save_buf: torch.Tensor | None = None
        self._save_ids: torch.Tensor | None = None

    def make_store(self) -> BlockStore:
        raise NotImplementedError

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> int | None:
        if not self.config.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0
        bs = self.layout.block_size
        start = num_computed_tokens // bs
        stop = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        if stop <= start:
            return 0
        if not self._remote_ready(request, start, stop):
            return None
        cached = self._pending.get(request.request_id)
        if cached is not None and cached[0] == start:  # a retry while waiting for blocks
            return len(cached[1]) * bs
        began = time.perf_counter()
        payloads: list[torch.Tensor] = []
        for block_hash in request.block_hashes[start:stop]:
            data = self.store.get(block_hash)
            if data is None:
                break
            payloads.append(data)
        self.stats.load_time_s += time.perf_counter() - began
        self.stats.lookups += 1
        self.stats.query_tokens += (stop - start) * bs
        self.stats.hit_tokens += len(payloads) * bs
        self.stats.merge(self.store.take_stats())  # misses found corrupt while reading
        if payloads:
            self._pending[request.request_id] = (start, payloads)
        return len(payloads) * bs

    def _remote_ready(self, request: Request, start: int, stop: int) -> bool:
        """A request whose prompt another instance prefills (`kv_transfer_params:
        {"do_remote_prefill": true}`) waits until its blocks are here, the source is gone
        or the timeout passes; then it takes what arrived and computes the rest."""
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if not params.get("do_remote_prefill") or rid in self._remote_done:
            return True
        now = time.monotonic()
        first = self._remote_first_seen.setdefault(rid, now)
        if all(self.store.contains(h) for h in request.block_hashes[start:stop]):
            self.stats.remote_waits += 1
        elif self.store.peer_dead or now - first >= self.config.remote_timeout_s:
            self.stats.remote_timeouts += 1
            logger.warning("request %s: the prefill instance's KV did not arrive (%s); "
                           "computing the prompt here", rid,
                           "peer gone" if self.store.peer_dead else
                           f"{self.config.remote_timeout_s:.0f} s timeout")
        else:
            return False
        self._remote_done.add(rid)
        self.stats.remote_wait_s += now - first
        return True

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        """`block_ids`: the new blocks for the external tokens, in order."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or not block_ids:
            return
        payloads = pending[1][: len(block_ids)]
        self._loads[request.request_id] = LoadSpec(list(block_ids), payloads)
        self.stats.blocks_loaded += len(payloads)
        self.stats.bytes_loaded += len(payloads) * self.layout.block_bytes

    def build_connector_meta(self, scheduled: list[tuple[Request, list[KVCacheBlock]]]
                             ) -> KVConnectorMetadata:
        """`scheduled`: each request of this step with its blocks (the manager's own
        list, not a copy: this runs every step), progress booked.
        Saves: the full blocks whose KV exists once this step's forward has run (their
        tokens are all known, so hashed) and that the store lacks."""
        meta = KVConnectorMetadata(self._loads)
        self._loads = {}
        if not self.config.is_producer:
            return meta
        bs = self.layout.block_size
        seen: set[bytes] = set()
        for request, blocks in scheduled:
            rid = request.request_id
            full = min(request.num_computed_tokens, request.num_tokens) // bs
            full = min(full, len(request.block_hashes), len(blocks))
            for i in range(self._saved_upto.get(rid, 0), full):
                block_hash = request.block_hashes[i]
                if block_hash in seen or block_hash in self._recent \
                        or self.store.contains(block_hash):
                    continue
                seen.add(block_hash)
                if self.remember_saves:
                    self._remember(block_hash)
                meta.save_hashes.append(block_hash)
                meta.save_block_ids.append(blocks[i].block_id)
            self._saved_upto[rid] = max(self._saved_upto.get(rid, 0), full)
        return meta

    def _remember(self, block_hash: bytes) -> None:
        self._recent[block_hash] = None
        if len(self._recent) > _RECENT_SAVES:
            self._recent.popitem(last=False)

    def forget_saves(self, block_hashes: list[bytes]) -> None:
        """These blocks' saves were dropped (their KV was wrong): save them again when a
        request computes them right."""
        for block_hash in block_hashes:
            self._recent.pop(block_hash, None)

    def request_finished(self, request: Request) -> bool:
        rid = request.request_id
        for table in (self._pending, self._saved_upto, self._remote_first_seen):
            table.pop(rid, None)
        self._remote_done.discard(rid)
        return False

    def update_connector_output(self, worker_stats: dict[str, float] | None) -> None:
        if worker_stats:
            self.stats.merge(worker_stats)

    def is_waiting_for_remote(self) -> bool:
        return bool(set(self._remote_first_seen) - self._remote_done)

    # ---- worker side ----------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata, kv_buffer: torch.Tensor) -> None:
        """Write every loaded block into `kv_buffer` ([layers, 2, blocks, ...]) before the
        forward reads it."""
        shape = self.layout.block_shape
        for spec in meta.loads.values():
            for block_id, data in zip(spec.block_ids, spec.payloads):
                block = data.view(self.layout.dtype).view(shape)
                kv_buffer[:, :, block_id].copy_(block.to(kv_buffer.device), non_blocking=True)

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads finish in `start_load_kv` (the graph is whole): nothing to wait for."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor,
                      meta: KVConnectorMetadata) -> None:
        """Copy layer `layer`'s blocks to save out of the cache ([2, blocks, ...]), so a
        block freed after this step may be reused at once."""
        if not meta.save_block_ids:
            return
        if layer == 0:
            n = len(meta.save_block_ids)
            self._save_buf = torch.empty((n, self.layout.block_bytes), dtype=torch.uint8)
            self._save_ids = torch.tensor(meta.save_block_ids, device=kv_layer.device)
        dest = self._save_buf.view(self.layout.dtype).view(-1, *self.layout.block_shape)
        dest[:, layer].copy_(kv_layer.index_select(1, self._save_ids).transpose(0, 1))

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Hand this step's copied blocks to the store (which may write them in the
        background); the cache's blocks are free to reuse on return."""
        if self._save_buf is None:
            return
        self.store.put(list(meta.save_hashes), self._save_buf)
        self._save_buf = None

    def take_worker_stats(self) -> dict[str, float]:
        return self.store.take_stats()

    def close(self) -> None:
        self.store.close()
