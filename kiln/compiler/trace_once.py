"""Trace a model's forward with Dynamo exactly once.

Every guard is dropped (`skip_all_guards_unsafe`) and only dim 0 of the inputs (the token
count) is dynamic, so the single trace serves every batch size: a later call never
re-enters Dynamo's tracer, and a token count of 1 does not trip a 0/1 specialisation.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.compiler.counter import compilation_counter
from kiln.ops import cpu_kernels


# Float attributes of modules (a norm's eps) are constants of the trace, as they are of
# the model, rather than symbolic inputs (torch's default): a compiled region takes only
# tensors and ints, and a constant costs nothing per call. Part of the compile-cache key.
DYNAMO_CONFIG = {"specialize_float": True}


def _no_guards() -> Callable[..., Any]:
    fn = getattr(torch.compiler, "skip_all_guards_unsafe", None)
    return fn if fn is not None else (lambda guards: [False] * len(guards))


class TraceOnceModel:
    """Callable stand-in for `model.forward(input_ids, positions)`.

    Warm start: the split graph is rebuilt from the compile cache and Dynamo never runs.
    Cold start: the first call traces (once) and compiles; every later call feeds the
    split graph directly, skipping Dynamo's frame hook. Where the graph cannot be called
    directly, calls go through Dynamo, whose dropped guards still prevent re-tracing.
    """

    def __init__(self, forward: Callable[..., Any], backend: Any) -> None:
        compilation_counter.num_models_seen += 1
        self.backend = backend
        self._direct = backend.load_saved()
        self._compiled = None
        if self._direct is not None:  # warm: the next call runs kernels (a cold one
            cpu_kernels.wait_planned()  # waits in the backend, after compiling)
        else:
            # Each engine traces its model class's `forward` once, but Dynamo counts every
            # trace of one code object as a recompile: without this the ninth cold engine
            # in a process (a test suite, a notebook, a server swapping models) would fail.
            limit = 1024
            if torch._dynamo.config.recompile_limit < limit:
                torch._dynamo.config.recompile_limit = limit
                torch._dynamo.config.accumulated_recompile_limit = max(
                    limit, torch._dynamo.config.accumulated_recompile_limit)
            self._compiled = torch.compile(forward, fullgraph=True, backend=backend,
                                           options={"guard_filter_fn": _no_guards()})
        self.traced = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._direct is not None:
            return self._direct(input_ids, positions)
        if self.traced:  # no direct call: Dynamo, without guards, never traces again
            return self._compiled(input_ids, positions)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        self.backend.current_inputs = (input_ids, positions)
        self.traced = True
        with torch._dynamo.config.patch(**DYNAMO_CONFIG):
            try:
                out = self._compiled(input_ids, positions)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                # The backend's last step waits for kernels built beside the trace; the
                # engine restarts without them if they failed, so that is raised as is.
                inner = getattr(exc, "inner_exception", None)
                if isinstance(inner, cpu_kernels.BuildFailed):
                    raise inner from None
                raise
        self._direct = self.backend.direct
        return out
