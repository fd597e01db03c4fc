"""Control messages between the engine and its worker processes, point to point.

A message is pickled once and sent to each worker as two tensors (its length, then its
bytes) with `isend`: the engine never waits for a busy worker to take it. That is what
lets a pipeline run several micro-batches at once: the engine hands step k+1 to the first
stage while the last stage still computes step k (a broadcast would wait for every rank).
torch.distributed keeps the order of messages per pair of ranks, so each worker sees the
engine's messages in the order they were sent.

The sender keeps each tensor referenced until its send completes (`Outbox.reap`). The
engine's wait for a step's result is bounded by the step bound (KILN_DIST_TIMEOUT_S):
a worker that hangs fails the step instead of the engine.
"""
from __future__ import annotations

import datetime
import pickle
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

_TAG = 7  # every message, both ways (p2p tags are matched per pair of ranks)


class Outbox:
    """The engine's sends in flight, kept alive until done."""

    def __init__(self) -> None:
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, obj: Any, ranks: list[int]) -> None:
        self.reap()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for rank in ranks:
            for t in (size, payload):
                self._pending.append((dist.isend(t, dst=rank, tag=_TAG), t))

    def reap(self) -> None:
        """Forget the sends that completed (in order: a later one completes after)."""
        while self._pending and self._pending[0][0].is_completed():
            self._pending[0][0].wait()  # raises if it failed
            self._pending.popleft()

    def flush(self) -> None:
        """Wait for every send (bounded by the group's timeout)."""
        while self._pending:
            self._pending.popleft()[0].wait()


def send_message(obj: Any, dst: int) -> None:
    """Send one message and wait until it is out (a worker's reply to the engine)."""
    box = Outbox()
    box.send(obj, [dst])
    box.flush()


def recv_message(src: int, timeout_s: float | None = None) -> Any:
    """The next message from rank `src`. `timeout_s` bounds each part's wait (gloo's
    blocking recv ignores the group's timeout); None waits as the group's default
    does."""
    size = torch.empty(1, dtype=torch.int64)
    _recv(size, src, timeout_s)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _recv(payload, src, timeout_s)
    return pickle.loads(payload.numpy().tobytes())


def _recv(t: torch.Tensor, src: int, timeout_s: float | None) -> None:
    work = dist.irecv(t, src=src, tag=_TAG)
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
