"""StructuredOutputManager: grammars compiled off the engine thread, one matcher per
request, and the batch's token bitmask each step.

Invariants:
- A request with a constraint is scheduled only once its grammar is compiled; until then
  it sits aside in the waiting queue and the rest of the batch runs (`is_ready`).
- Its matcher has accepted exactly the request's output tokens: `accept` runs on every
  token the scheduler appends, and preemption keeps the outputs (so the state too).
- The bitmask rows are the requests that sample this step, in batch order; a bit is set
  where the token may come next. EOS is allowed only where the grammar may end.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr

from kiln.structured_output.backend import XgrammarBackend, backend_message, grammar_for
from kiln.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept by constraint (the futures, done or not)


@dataclass(slots=True)
class StructuredOutputRequest:
    """One request's constraint: its compile future, then its matcher."""

    params: StructuredOutputsParams
    future: Future
    deadline: float  # time.monotonic() after which a pending compile fails the request
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = None

    def accept(self, token_id: int) -> None:
        if self.matcher is None or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            # Only a sampler that ignored the mask gets here: a bug, logged, not fatal.
            logger.warning("grammar rejected token %d", token_id)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float = 30.0, max_workers: int | None = None) -> None:
        workers = max_workers or max(1, (os.cpu_count() or 2) // 2)  # as vLLM: half
        self.backend = XgrammarBackend(tokenizer, vocab_size, eos_token_ids, workers)
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kiln-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask = self.backend.allocate_bitmask(1)
        self.fill_s = 0.0  # time spent filling bitmasks (what a step pays on the host)
        self.fill_steps = 0

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compile future for this constraint, shared by equal constraints. A new
        constraint is parsed here, on the caller's thread (milliseconds: a malformed one
        is a ValueError naming the field), and compiled in the pool; an equal one seen
        before costs a dictionary lookup."""
        key = params.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
        grammar = grammar_for(params)
        with self._lock:
            fut = self._pool.submit(self.backend.compiler.compile_grammar, grammar)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def new_request(self, params: StructuredOutputsParams,
                    future: Future) -> StructuredOutputRequest:
        """One sample's state for a constraint `submit` returned `future` for."""
        return StructuredOutputRequest(params, future,
                                       time.monotonic() + self.compile_timeout_s)

    def is_ready(self, so: StructuredOutputRequest) -> bool:
        """True once the matcher exists. A failed or overdue compile sets `so.error`
        (the scheduler then fails that request alone) and returns False."""
        if so.matcher is not None:
            return True
        if not so.future.done():
            if time.monotonic() > so.deadline:
                so.error = (f"structured_outputs.{so.params.kind}: the grammar did not "
                            f"compile within {self.compile_timeout_s:.0f} s")
            return False
        exc = so.future.exception()
        if exc is not None:
            so.error = f"structured_outputs.{so.params.kind}: {backend_message(exc)}"
            return False
        so.matcher = self.backend.matcher(so.future.result())
        return True

    def bitmask(self, rows: list[StructuredOutputRequest | None]) -> np.ndarray | None:
        """[len(rows), ceil(V/32)] int32 for this step's sampling rows; None when no row
        is constrained. Unconstrained rows and finished grammars allow every token."""
        if not any(r is not None for r in rows):
            return None
        start = time.perf_counter()
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = self.backend.allocate_bitmask(len(rows))
        mask = self._bitmask[: len(rows)]
        mask.fill_(-1)
        for i, so in enumerate(rows):
            if so is not None and so.matcher is not None and not so.matcher.is_terminated():
                so.matcher.fill_next_token_bitmask(self._bitmask, i)
        out = mask.numpy().copy()
        self.fill_s += time.perf_counter() - start
        self.fill_steps += 1
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
