"""CUDAGraphWrapper: captures a runnable once per batch descriptor, replays it after.

The wrapper obeys the dispatcher: it reads the runtime mode and descriptor from the
forward context and passes straight through when the mode is NONE or not its own. So a
FULL wrapper around the whole model and PIECEWISE wrappers around each compiled piece
nest: on a FULL step the inner ones pass through (and are captured inside the outer
graph), on a PIECEWISE step the outer one does.

Captures happen only inside `capture_phase()` (start-up); a descriptor first seen while
serving is a bug (the dispatcher handed out a key nobody captured) and raises.
"""
from __future__ import annotations

import gc
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

from kiln.attention.forward_context import BatchDescriptor, get_forward_context_or_none
from kiln.config.compilation import CUDAGraphMode
from kiln.graphs.graph import Graph, weak_ref_tensors

logger = logging.getLogger(__name__)

GraphFactory = Callable[[str], Graph]


@dataclass(slots=True)
class GraphEntry:
    descriptor: BatchDescriptor
    graph: Graph
    output: Any  # weak views of the captured output (CUDA); the tensors themselves (CPU)


@dataclass(slots=True)
class _Phase:
    active: bool = False
    num_captures: int = 0


_phase = _Phase()


@contextmanager
def capture_phase() -> Iterator[None]:
    """Start-up capture: collect once, then freeze and disable the garbage collector (a
    collection mid-capture can free objects a graph still points at, and one collection
    per graph would dominate start-up); captures are refused outside this block."""
    if _phase.active:
        raise RuntimeError("capture_phase() is already active")
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    _phase.active, _phase.num_captures = True, 0
    try:
        yield
    finally:
        _phase.active = False
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def capturing_enabled() -> bool:
    return _phase.active


class CUDAGraphWrapper:
    """Wraps `runnable` for one runtime mode (FULL or PIECEWISE).

    It owns no input buffers: callers feed the same tensors on every replay of a
    descriptor (the runner's persistent buffers; for pieces, the previous graph's outputs).
    `weak_ref_output` lets the pool reuse output memory across captures; the output of a
    replay is valid until the next replay of any graph in the pool.
    """

    _instances: ClassVar[weakref.WeakSet[CUDAGraphWrapper]] = weakref.WeakSet()

    def __init__(self, runnable: Callable[..., Any], mode: CUDAGraphMode,
                 graph_factory: GraphFactory, name: str = "",
                 weak_ref_output: bool = True) -> None:
        if mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(f"a CUDAGraphWrapper runs FULL or PIECEWISE, not {mode}")
        self.runnable, self.mode, self.name = runnable, mode, name or mode.name
        self.graph_factory = graph_factory
        self.weak_ref_output = weak_ref_output
        self.entries: dict[BatchDescriptor, GraphEntry] = {}
        self.num_captures = self.num_replays = 0
        CUDAGraphWrapper._instances.add(self)

    def __call__(self, *args: Any) -> Any:
        ctx = get_forward_context_or_none()
        if ctx is None or ctx.cudagraph_mode is not self.mode or ctx.batch_descriptor is None:
            return self.runnable(*args)
        desc = ctx.batch_descriptor
        entry = self.entries.get(desc)
        if entry is None:
            return self._capture(desc, args)
        entry.graph.replay(args)
        self.num_replays += 1
        return entry.output

    def _capture(self, desc: BatchDescriptor, args: tuple[Any, ...]) -> Any:
        if not capturing_enabled():
            raise RuntimeError(
                f"graph {self.name}: {desc} was never captured and capture is only allowed "
                "during start-up (ModelRunner.capture_model); the dispatcher must not hand "
                "out keys that were not captured")
        graph = self.graph_factory(f"{self.name}[{desc.num_tokens}]")
        output = graph.capture(self.runnable, args, self.weak_ref_output,
                               first_in_phase=_phase.num_captures == 0)
        _phase.num_captures += 1
        self.entries[desc] = GraphEntry(desc, graph, weak_ref_tensors(output))
        self.num_captures += 1
        logger.debug("captured %s for %s", self.name, desc)
        return output

    def unwrap(self) -> Callable[..., Any]:
        inner = self.runnable
        return inner.unwrap() if isinstance(inner, CUDAGraphWrapper) else inner

    def __getattr__(self, name: str) -> Any:
        if name == "runnable":  # not set yet: avoid recursing
            raise AttributeError(name)
        return getattr(self.runnable, name)

    @classmethod
    def clear_all_graphs(cls) -> None:
        for wrapper in list(cls._instances):
            wrapper.entries.clear()
