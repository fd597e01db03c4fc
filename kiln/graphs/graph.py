"""Graph objects with one capture/replay interface: the real `torch.cuda.CUDAGraph`, and a
CPU test graph that plays by the same rules where no CUDA exists.

The rule that matters is static addresses: a captured graph replays its kernels on the
memory it saw at capture time, so every replay must be fed the very tensors it captured
(the runner's persistent buffers, the previous piece's outputs) and hands back the same
output tensors, overwritten. `CpuTestGraph` enforces that on every replay; the CUDA graph
checks it when asked (debugging), as a wrong address there is silent.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Protocol, Sequence
from unittest import mock

import torch

GraphFn = Callable[..., Any]


class Graph(Protocol):
    def capture(self, fn: GraphFn, args: Sequence[Any], weak_ref_output: bool,
                first_in_phase: bool) -> Any:
        """Run `fn(*args)` once while recording it; returns its (strong) output."""

    def replay(self, args: Sequence[Any]) -> None:
        """Re-run the recorded work; the captured output tensors now hold the results."""


def _signature(args: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What a replay must match: each tensor's address and shape, every other value."""
    return [("tensor", a.data_ptr(), tuple(a.shape)) if isinstance(a, torch.Tensor)
            else ("value", a) for a in args]


def check_same_inputs(captured: list[tuple[Any, ...]], args: Sequence[Any], name: str) -> None:
    now = _signature(args)
    if len(now) != len(captured):
        raise RuntimeError(f"graph {name}: replayed with {len(now)} inputs, captured with "
                           f"{len(captured)}")
    for i, (was, is_) in enumerate(zip(captured, now)):
        if was != is_:
            raise RuntimeError(
                f"graph {name}: input {i} moved since capture ({was} -> {is_}); a graph "
                "replays on the captured addresses, so inputs must live in persistent "
                "buffers (the runner's) or be the previous graph's outputs")


class CpuTestGraph:
    """A test double for `torch.cuda.CUDAGraph` on the CPU.

    Capture runs the function and keeps its inputs and outputs; replay checks that the
    inputs are the captured tensors (same address, same shape, same non-tensor values,
    which a real graph bakes in), re-runs the function on them and copies the results
    into the captured outputs, so callers see the aliasing a real replay gives them.
    It does not freeze host-side values read during the run (a real graph would), so
    FULL correctness of an attention backend still needs a GPU test.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._fn: GraphFn | None = None
        self._args: tuple[Any, ...] = ()
        self._signature: list[tuple[Any, ...]] = []
        self._output: Any = None

    def capture(self, fn: GraphFn, args: Sequence[Any], weak_ref_output: bool,
                first_in_phase: bool) -> Any:
        self._fn, self._args, self._signature = fn, tuple(args), _signature(args)
        self._output = fn(*args)
        return self._output

    def replay(self, args: Sequence[Any]) -> None:
        if self._fn is None:
            raise RuntimeError(f"graph {self.name}: replay before capture")
        check_same_inputs(self._signature, args, self.name)
        _copy_into(self._output, self._fn(*self._args))


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class CudaGraph:
    """`torch.cuda.CUDAGraph` captured into the process-wide pool."""

    def __init__(self, pool: Any, name: str = "", check_addresses: bool = False) -> None:
        self.name = name
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.check_addresses = check_addresses
        self._signature: list[tuple[Any, ...]] = []

    def capture(self, fn: GraphFn, args: Sequence[Any], weak_ref_output: bool,
                first_in_phase: bool) -> Any:
        self._signature = _signature(args)
        with ExitStack() as stack:
            if not first_in_phase:
                # torch.cuda.graph() runs gc.collect() and empty_cache() on entry; with a
                # graph per piece per size that dominates start-up, and the first capture
                # of the phase already did both.
                stack.enter_context(mock.patch("gc.collect", lambda *a, **k: 0))
                stack.enter_context(mock.patch("torch.cuda.empty_cache", lambda: None))
            # torch's shared side stream: capture is illegal on the legacy default stream.
            stack.enter_context(torch.cuda.graph(self.graph, pool=self.pool))
            output = fn(*args)
            if weak_ref_output:
                # Dropping the strong reference inside the capture returns the memory to
                # the pool for the next (smaller) capture; the weak view still reads it.
                output = weak_ref_tensors(output)
        return output

    def replay(self, args: Sequence[Any]) -> None:
        if self.check_addresses:
            check_same_inputs(self._signature, args, self.name)
        self.graph.replay()


def weak_ref_tensors(value: Any) -> Any:
    """Tensors that alias `value`'s memory without keeping it alive (CUDA only: the graph
    pool owns that memory). Other values pass through."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            return value
        storage = torch._C._construct_storage_from_data_pointer(
            value.untyped_storage().data_ptr(), value.device,
            value.untyped_storage().nbytes())
        return torch.empty((), dtype=value.dtype, device=value.device).set_(
            storage, value.storage_offset(), value.shape, value.stride())
    if isinstance(value, (tuple, list)):
        return type(value)(weak_ref_tensors(v) for v in value)
    return value


_POOL: Any = None
_POOL_KEEPER: Any = None


def global_graph_pool() -> Any:
    """One memory pool for every CUDA graph of the process, FULL and PIECEWISE alike.

    A pool handle alone holds no reference: once every graph captured into it is freed
    (an engine torn down) while one of its blocks is still alive, the allocator parks the
    pool with a use count of 0, and the next capture into the same handle fails an internal
    assert (`use_count > 0`, torch 2.11). A tiny graph captured into the pool and kept for
    the life of the process holds one reference, so the handle stays valid."""
    global _POOL, _POOL_KEEPER
    if _POOL is None:
        pool = torch.cuda.graph_pool_handle()
        keeper = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keeper, pool=pool):
            torch.zeros(1, device="cuda").add_(1)  # not empty: torch warns on empty graphs
        _POOL, _POOL_KEEPER = pool, keeper
    return _POOL
