"""KilnBackend: the Dynamo backend. Split at attention, compile every piece for every
size and range before returning, reuse identical pieces, go through the compile cache."""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from torch import fx
from tqdm import tqdm

from kiln.compiler.adaptors import CompilerAdaptor
from kiln.compiler.cache import CompileCache
from kiln.compiler.counter import compilation_counter
from kiln.compiler.pieces import (concrete_args, graph_signature, record_piece_args,
                                  returns_tuple, token_dim_position)
from kiln.compiler.piecewise import PiecewiseBackend, Range
from kiln.compiler.split import SplitItem, split_graph

logger = logging.getLogger(__name__)


class KilnBackend:
    """Called by Dynamo exactly once per model; returns the stitching module whose
    compiled pieces are `PiecewiseBackend`s."""

    def __init__(self, adaptor: CompilerAdaptor, splitting_ops: Sequence[str],
                 shapes: Sequence[Range], cache: CompileCache | None,
                 progress: bool = True) -> None:
        self.adaptor, self.splitting_ops, self.shapes = adaptor, list(splitting_ops), shapes
        self.cache = cache if adaptor.saves_artifacts else None
        self.progress = progress
        self.compile_time_s = 0.0
        self.split_gm: fx.GraphModule | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if self.split_gm is not None:
            raise RuntimeError("KilnBackend is called once per model: Dynamo traced twice, "
                               "which means guards were not dropped")
        start = time.perf_counter()
        compilation_counter.num_graphs_seen += 1
        split_gm, items = split_graph(gm, self.splitting_ops)
        piece_args = record_piece_args(split_gm, example_inputs)
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compiled = [item for item in items if not item.is_splitting]
        compilation_counter.num_piecewise_capturable_graphs_seen += len(compiled)
        unique: dict[str, PiecewiseBackend] = {}
        bar = tqdm(compiled, desc="compiling pieces", unit="piece", disable=not self.progress)
        for item in bar:
            args = piece_args[item.name]
            sig = graph_signature(item.graph, args)
            if sig not in unique:
                unique[sig] = self._build(item, args, sig)
            split_gm.__dict__[item.name] = unique[sig]  # shadows the submodule
        compilation_counter.num_unique_graphs += len(unique)
        self.split_gm = split_gm
        self.compile_time_s = time.perf_counter() - start
        logger.info("compiled %d pieces (%d unique) for %s in %.1f s", len(compiled),
                    len(unique), ", ".join(map(str, self.shapes)), self.compile_time_s)
        return split_gm

    def _build(self, item: SplitItem, args: tuple[Any, ...], sig: str) -> PiecewiseBackend:
        position = token_dim_position(args)
        shapes = self.shapes if position is not None else self.shapes[-1:]
        runnables = {}
        for shape in shapes:
            compilation_counter.num_backend_compilations += 1
            runnables[shape] = self._build_one(item, args, sig, shape, position is not None)
        return PiecewiseBackend(item.name, runnables, position, returns_tuple(item.graph))

    def _build_one(self, item: SplitItem, args: tuple[Any, ...], sig: str, shape: Range,
                   dynamic_piece: bool) -> Any:
        static = shape.is_single_size and dynamic_piece
        example = concrete_args(args, shape.start) if static else args
        if self.cache is None:
            return self.adaptor.compile(item.graph, example, not static, None)
        name = f"{sig[:20]}-{self.adaptor.name}-{shape}"
        fn = self.cache.load(name, self.adaptor.load)
        if fn is not None:
            return fn
        return self.cache.save(name, lambda tmp: self.adaptor.compile(item.graph, example,
                                                                       not static, tmp))
