"""`kv_connector: "torch_distributed"`: a prefill instance pushes blocks to a decode
instance over a two-rank gloo process group (torch.distributed; no home-made sockets).

The producer (rank 0) hosts the rendezvous `TCPStore` at `kv_ip:kv_port`; the consumer
(rank 1) joins it whenever it starts. Both connect in the background, so either may start
first and neither blocks its start-up. Each message is one step's blocks: a header
tensor [num_blocks, payload bytes], then one uint8 tensor holding the namespace, the block
hashes and the payloads. The consumer keeps received blocks in memory (an LRU bounded by
`max_size`) and its scheduler loads them like any other external hit. Blocks from a
producer with another namespace (model, dtype, layout) are dropped with one warning.

A link that fails (the peer exited) stays down: the producer drops its sends, the
consumer's waiting requests compute their prompts at once. Restart both to reconnect.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from kiln.kv_transfer.base import BlockStore, KVConnector, KVConnectorRole
from kiln.kv_transfer.layout import KVLayout
from kiln.kv_transfer.stats import Counters

logger = logging.getLogger(__name__)
_HASH = 16
_NS = 16
_OP_TIMEOUT = datetime.timedelta(days=7)  # a recv waits for the next message this long
_MAX_QUEUED = 64  # steps of blocks a producer holds while unconnected, then drops


class PeerLink:
    """The gloo pair, connected by a background thread; `group` is None until then."""

    def __init__(self, ip: str, port: int, rank: int, connect_timeout_s: float) -> None:
        self.ip, self.port, self.rank = ip, port, rank
        self.connect_timeout_s = connect_timeout_s
        self.group: dist.ProcessGroupGloo | None = None
        self.connected = threading.Event()
        self.dead = False
        # The producer binds its rendezvous port now: a taken port is a start-up error.
        self._store = self._open_store() if rank == 0 else None
        threading.Thread(target=self._connect, name="kiln-kv-connect", daemon=True).start()

    def _open_store(self) -> dist.TCPStore:
        # A consumer retries in short attempts (the producer may start much later).
        timeout = datetime.timedelta(seconds=30 if self.rank == 0 else 2)
        try:
            return dist.TCPStore(self.ip, self.port, 2, is_master=self.rank == 0,
                                 timeout=timeout, wait_for_workers=False)
        except Exception as exc:
            if self.rank == 0:
                raise ValueError(f"kv_transfer_config: the producer cannot listen on "
                                 f"kv_ip:kv_port={self.ip}:{self.port} ({exc}); pick a free "
                                 "kv_port and give the consumer the same one") from None
            raise

    def _connect(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        while not self.dead:
            try:
                store = self._store or self._open_store()
                self._store = store
                self.group = dist.ProcessGroupGloo(dist.PrefixStore("kiln-kv", store),
                                                   self.rank, 2, _OP_TIMEOUT)
                self.connected.set()
                logger.info("KV link up: rank %d of %s:%d", self.rank, self.ip, self.port)
                return
            except Exception as exc:  # the peer is not up yet, or the port is taken
                if self.rank == 0 or time.monotonic() > deadline:
                    logger.warning("KV link to %s:%d failed: %s", self.ip, self.port, exc)
                    self.dead = True
                    return
                time.sleep(0.5)

    def close(self) -> None:
        """Stop connecting and using the link (the engine is shutting down)."""
        self.dead = True

    def fail(self, exc: BaseException) -> None:
        if not self.dead:
            logger.warning("KV link to %s:%d is down (%s): restart both instances to "
                           "reconnect", self.ip, self.port, exc)
        self.dead = True


class SenderStore(BlockStore):
    """The producer's worker side: `put` queues one message; a thread sends it."""

    def __init__(self, link: PeerLink, layout: KVLayout) -> None:
        self.link, self.layout = link, layout
        self._queue: queue.Queue = queue.Queue()
        self._counts = Counters()
        threading.Thread(target=self._run, name="kiln-kv-send", daemon=True).start()

    def contains(self, block_hash: bytes) -> bool:
        return False  # the consumer may have evicted anything: always send

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        return None

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        if self.link.dead or self._queue.qsize() >= _MAX_QUEUED:
            self._counts.add("save_failures", len(hashes))
            return
        self._queue.put((hashes, payload))

    def _run(self) -> None:
        self.link.connected.wait()
        while not self.link.dead:
            hashes, payload = self._queue.get()
            if hashes is None:
                return
            start = time.perf_counter()
            body = torch.cat([torch.frombuffer(bytearray(self.layout.namespace_digest
                                                         + b"".join(hashes)),
                                               dtype=torch.uint8), payload.reshape(-1)])
            try:
                header = torch.tensor([len(hashes), body.numel()], dtype=torch.int64)
                self.link.group.send([header], 1, 0).wait()
                self.link.group.send([body], 1, 1).wait()
            except Exception as exc:
                self.link.fail(exc)
                self._counts.add("save_failures", len(hashes))
                return
            self._counts.add("blocks_saved", len(hashes))
            self._counts.add("bytes_saved", payload.numel())
            self._counts.add("save_time_s", time.perf_counter() - start)
            self._queue.task_done()

    def flush(self) -> None:
        """Wait while messages are queued and the link can still carry them."""
        while self._queue.unfinished_tasks and self.link.connected.is_set() \
                and not self.link.dead:
            time.sleep(0.005)

    def take_stats(self) -> dict[str, float]:
        return self._counts.take()

    def close(self) -> None:
        self.flush()
        self.link.close()


class ReceiverStore(BlockStore):
    """The consumer's scheduler side: blocks received, in memory, LRU within max_size."""

    def __init__(self, link: PeerLink, layout: KVLayout, max_size: int) -> None:
        self.link, self.layout = link, layout
        self.max_blocks = max(1, max_size // layout.block_bytes)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._evicted = 0
        self._warned = False
        threading.Thread(target=self._run, name="kiln-kv-recv", daemon=True).start()

    @property
    def peer_dead(self) -> bool:  # type: ignore[override]
        return self.link.dead

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            data = self._blocks.get(block_hash)
            if data is not None:
                self._blocks.move_to_end(block_hash)
            return data

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        raise RuntimeError("a kv_consumer does not save blocks")

    def _run(self) -> None:
        self.link.connected.wait()
        while not self.link.dead:
            header = torch.empty(2, dtype=torch.int64)
            try:
                self.link.group.recv([header], 0, 0).wait()
                body = torch.empty(int(header[1]), dtype=torch.uint8)
                self.link.group.recv([body], 0, 1).wait()
            except Exception as exc:
                self.link.fail(exc)
                return
            self._accept(int(header[0]), body)

    def _accept(self, n: int, body: torch.Tensor) -> None:
        raw = body[: _NS + n * _HASH].numpy().tobytes()
        if raw[:_NS] != self.layout.namespace_digest:
            if not self._warned:
                logger.warning("the KV producer runs another model, dtype or layout: its "
                               "blocks are dropped (start both instances alike)")
                self._warned = True
            return
        payload = body[_NS + n * _HASH:].view(n, self.layout.block_bytes)
        with self._lock:
            for i in range(n):
                block_hash = raw[_NS + i * _HASH: _NS + (i + 1) * _HASH]
                self._blocks[block_hash] = payload[i]
                self._blocks.move_to_end(block_hash)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
                self._evicted += 1

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            evicted, self._evicted = self._evicted, 0
        return {"blocks_evicted": evicted} if evicted else {}

    def close(self) -> None:
        self.link.close()


class _NullStore(BlockStore):
    """A role that neither loads nor sends (the producer's scheduler, the consumer's
    worker): nothing is ever stored, so every full block counts as a save to make."""

    def contains(self, block_hash: bytes) -> bool:
        return False

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        return None

    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        raise RuntimeError("this side of the torch_distributed connector moves no blocks")


class TorchDistributedConnector(KVConnector):
    name = "torch_distributed"
    remember_saves = False  # the consumer's memory may have evicted any block

    def make_store(self) -> BlockStore:
        c = self.config
        producer = c.kv_role == "kv_producer"
        worker = self.role is KVConnectorRole.WORKER
        if producer != worker:  # the producer sends from its worker; the consumer
            return _NullStore()  # receives for its scheduler
        timeout = float(c.kv_connector_extra_config.get("connect_timeout_s", 600.0))
        link = PeerLink(c.kv_ip, c.kv_port, 0 if producer else 1, timeout)
        return SenderStore(link, self.layout) if producer else \
            ReceiverStore(link, self.layout, c.max_size)
