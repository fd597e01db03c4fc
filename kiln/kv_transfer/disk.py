"""The disk tier: one file per block, `<path>/<namespace>/<hh>/<block hash>.kvb`.

Written the way the compile cache writes: a temporary file in the same directory, then an
atomic rename, so a reader sees a whole block or nothing (a writer killed mid-save leaves
only a temporary file, which eviction sweeps). Each file carries a header (magic, its own
block hash, the namespace, payload length, xxh3 checksum of the payload); a missing,
truncated or corrupt file is a miss, deleted so that the recomputed block replaces it.

`max_size` bounds the whole directory (every namespace in it): before writing, a writer
whose running estimate would pass the budget takes the directory's lock, rescans it and
deletes the least recently used blocks (a hit refreshes the file's mtime). Many processes
may share one directory: renames are atomic, eviction is serialized by `flock`, and a
reader racing a deletion simply misses.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from kiln.kv_transfer.base import BlockStore, KVConnector, KVConnectorRole
from kiln.kv_transfer.layout import KVLayout
from kiln.kv_transfer.stats import Counters

logger = logging.getLogger(__name__)
MAGIC = b"KILNKVB1"
_HEADER = struct.Struct("<8s16s16sQQ")  # magic, block hash, namespace, payload bytes, xxh3
SUFFIX = ".kvb"
_STALE_TMP_S = 60.0  # a temporary file this old belongs to a writer that died
_LOW_WATER = 0.9  # eviction frees down to this fraction of the budget


def _checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class DiskBlockStore(BlockStore):
    def __init__(self, root: str | Path, layout: KVLayout, max_size: int,
                 writer: bool) -> None:
        self.root = Path(root).expanduser()
        self.dir = self.root / layout.namespace
        self.layout, self.max_size = layout, max_size
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_identity()
        self._counts = Counters()
        self._futures: list[Future] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-kv-disk") if writer \
            else None
        self._estimate = self._scan()[0] if writer else 0

    def _write_identity(self) -> None:
        """What the namespace holds, for people (the blocks never read it)."""
        target = self.dir / "layout.json"
        if not target.exists():
            tmp = target.with_name(f".layout.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(self.layout.identity)
            os.replace(tmp, target)

    def path_of(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def take_stats(self) -> dict[str, float]:
        return self._counts.take()

    # ---- reads ----------------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        return self.path_of(block_hash).exists()

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        path = self.path_of(block_hash)
        nbytes = self.layout.block_bytes
        out = torch.empty(nbytes, dtype=torch.uint8)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                got = f.readinto(memoryview(out.numpy()))
                extra = f.read(1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("KV block %s unreadable (%s): recomputing it", path.name, exc)
            return self._bad(path)
        if len(header) < _HEADER.size or got != nbytes or extra:
            return self._bad(path, "truncated or oversized")
        magic, stored_hash, namespace, length, checksum = _HEADER.unpack(header)
        if magic != MAGIC or stored_hash != block_hash or length != nbytes \
                or namespace != self.layout.namespace_digest:
            return self._bad(path, "header does not match")
        if _checksum(memoryview(out.numpy())) != checksum:
            return self._bad(path, "checksum mismatch")
        try:
            os.utime(path)  # a hit is a use: least recently used blocks go first
        except OSError:
            pass
        return out

    def _bad(self, path: Path, why: str = "") -> None:
        if why:
            logger.warning("KV block %s is corrupt (%s): recomputing it", path.name, why)
        self._counts.add("load_failures")
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # ---- writes ---------------------------------------------------------------------------
    def put(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        if self._pool is None:
            raise RuntimeError("this disk store was opened read-only (the scheduler side)")
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._write_all, hashes, payload))

    def _write_all(self, hashes: list[bytes], payload: torch.Tensor) -> None:
        start = time.perf_counter()
        nbytes = self.layout.block_bytes + _HEADER.size
        room = self.max_size // nbytes
        hashes = hashes[:room]  # a batch larger than the whole budget keeps its head
        if self._estimate + len(hashes) * nbytes > self.max_size:
            self._evict(len(hashes) * nbytes)
        for i, block_hash in enumerate(hashes):
            try:
                self._write(block_hash, payload[i].numpy())
            except OSError as exc:
                logger.warning("could not save KV block %s: %s", block_hash.hex(), exc)
                self._counts.add("save_failures")
                continue
            self._estimate += nbytes
            self._counts.add("blocks_saved")
            self._counts.add("bytes_saved", self.layout.block_bytes)
        self._counts.add("save_time_s", time.perf_counter() - start)

    def _write(self, block_hash: bytes, data: np.ndarray) -> None:
        final = self.path_of(block_hash)
        final.parent.mkdir(exist_ok=True)
        header = _HEADER.pack(MAGIC, block_hash, self.layout.namespace_digest, data.nbytes,
                              _checksum(memoryview(data)))
        tmp = final.with_name(f"{final.name}.tmp.{os.getpid()}.{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(data))
            os.replace(tmp, final)  # atomic: readers see the whole block or none
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def flush(self) -> None:
        for future in self._futures:
            future.result()
        self._futures = []

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ---- the size budget ------------------------------------------------------------------
    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of every block under the root; sweeps dead temporaries."""
        out = []
        now = time.time()
        for entry in _walk(self.root):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(SUFFIX):
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
            elif ".tmp." in entry.name and now - st.st_mtime > _STALE_TMP_S:
                Path(entry.path).unlink(missing_ok=True)
        return out

    def _scan(self) -> tuple[int, list[tuple[float, int, Path]]]:
        files = self._files()
        return sum(f[1] for f in files), files

    def _evict(self, incoming: int) -> None:
        """Delete least recently used blocks until `incoming` more bytes fit under the
        low-water mark; serialized across processes by the root's lock file."""
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            total, files = self._scan()
            target = min(int(self.max_size * _LOW_WATER), self.max_size - incoming)
            for _, size, path in sorted(files):
                if total <= target:
                    break
                try:
                    path.unlink()
                except OSError:
                    continue
                total -= size
                self._counts.add("blocks_evicted")
            self._estimate = total


def _walk(root: Path):
    """Entries two levels below each namespace: <root>/<ns>/<hh>/<file>."""
    for ns in os.scandir(root):
        if not ns.is_dir():
            continue
        for fan in os.scandir(ns.path):
            if fan.is_dir():
                yield from os.scandir(fan.path)


class DiskConnector(KVConnector):
    """`kv_connector: "disk"`: a persistent tier shared by every process on the host."""

    name = "disk"

    def make_store(self) -> BlockStore:
        path = self.config.kv_connector_extra_config["path"]
        return DiskBlockStore(path, self.layout, self.config.max_size,
                              writer=self.role is KVConnectorRole.WORKER
                              and self.config.is_producer)
