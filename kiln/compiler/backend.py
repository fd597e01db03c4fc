"""KilnBackend: the Dynamo backend. Split at attention, compile every piece for every
size and range before returning, reuse identical pieces, go through the compile cache."""
from __future__ import annotations

import logging
import pickle
import time
from typing import Any, Sequence

from torch import fx, nn
from tqdm import tqdm

from kiln.compiler.adaptors import CompilerAdaptor
from kiln.compiler.cache import CompileCache
from kiln.compiler.counter import compilation_counter
from kiln.compiler.graph_io import (DirectCaller, NotSerializable, check_single_output,
                                    dump_graph, input_recipe, load_graph)
from kiln.compiler.pieces import (concrete_args, graph_signature, record_piece_args,
                                  returns_tuple, token_dim_position)
from kiln.compiler.piecewise import PiecewiseBackend, Range
from kiln.compiler.split import SplitItem, split_graph
from kiln.ops import cpu_kernels

logger = logging.getLogger(__name__)


class KilnBackend:
    """Called by Dynamo exactly once per model; returns the stitching module whose
    compiled pieces are `PiecewiseBackend`s."""

    def __init__(self, model: nn.Module, adaptor: CompilerAdaptor,
                 splitting_ops: Sequence[str], shapes: Sequence[Range],
                 cache: CompileCache | None, progress: bool = True) -> None:
        self.model = model
        self.adaptor, self.splitting_ops, self.shapes = adaptor, list(splitting_ops), shapes
        self.cache = cache if adaptor.saves_artifacts else None
        self.progress = progress
        self.compile_time_s = 0.0
        self.split_gm: fx.GraphModule | None = None
        self.current_inputs: tuple[Any, ...] = ()  # set by the caller before the trace
        self.direct: DirectCaller | None = None  # how to call split_gm without Dynamo
        self._pieces: dict[str, dict[str, Any]] = {}  # submod -> artifacts, for graph.pkl

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
            self._pieces[item.name] = {"sig": sig, "position": unique[sig].token_position,
                                       "returns_tuple": unique[sig].returns_tuple}
        compilation_counter.num_unique_graphs += len(unique)
        self.split_gm = split_gm
        self._prepare_direct_call(split_gm, items, example_inputs)
        self.compile_time_s = time.perf_counter() - start
        logger.info("compiled %d pieces (%d unique) for %s in %.1f s", len(compiled),
                    len(unique), ", ".join(map(str, self.shapes)), self.compile_time_s)
        # Dynamo runs the graph as soon as this returns: the kernels it calls, built
        # beside the trace on a first start, load first.
        cpu_kernels.wait_planned()
        return split_gm

    def _build(self, item: SplitItem, args: tuple[Any, ...], sig: str) -> PiecewiseBackend:
        position = token_dim_position(args)
        shapes = self.shapes if position is not None else self.shapes[-1:]
        runnables = {}
        for shape in shapes:
            compilation_counter.num_backend_compilations += 1
            runnables[shape] = self._build_one(item, args, sig, shape, position is not None)
        return PiecewiseBackend(item.name, runnables, position, returns_tuple(item.graph))

    def _artifact_name(self, sig: str, shape: Range) -> str:
        return f"{sig[:20]}-{self.adaptor.name}-{shape}"

    def _build_one(self, item: SplitItem, args: tuple[Any, ...], sig: str, shape: Range,
                   dynamic_piece: bool) -> Any:
        static = shape.is_single_size and dynamic_piece
        example = concrete_args(args, shape.start) if static else args
        if self.cache is None:
            return self.adaptor.compile(item.graph, example, not static, None)
        name = self._artifact_name(sig, shape)
        fn = self.cache.load(name, self.adaptor.load)
        if fn is not None:
            return fn
        return self.cache.save(name, lambda tmp: self.adaptor.compile(item.graph, example,
                                                                       not static, tmp))

    # ---- skipping Dynamo: after the trace, and on a warm start ---------------------------
    def _prepare_direct_call(self, split_gm: fx.GraphModule, items: list[SplitItem],
                             example_inputs: Sequence[Any]) -> None:
        try:
            check_single_output(split_gm)
            recipe = input_recipe(self.model, example_inputs, self.current_inputs)
            record = {"stitch": dump_graph(split_gm), "recipe": recipe,
                      "splitting": {i.name: dump_graph(i.graph) for i in items
                                    if i.is_splitting},
                      "pieces": self._pieces, "shapes": [str(s) for s in self.shapes]}
        except NotSerializable as exc:
            logger.info("calls keep going through Dynamo: %s", exc)
            return
        self.direct = DirectCaller(split_gm, self.model, recipe)
        if self.cache is not None:
            blob = pickle.dumps(record)
            self.cache.write_blob("graph.pkl", blob)

    def load_saved(self) -> DirectCaller | None:
        """Rebuild the split graph from the cache without Dynamo, or None (then trace)."""
        if self.cache is None:
            return None
        start = time.perf_counter()
        blob = self.cache.read_blob("graph.pkl")
        if blob is None:
            return None
        try:
            saved = pickle.loads(blob)
            root = nn.Module()
            for name, records in saved["splitting"].items():
                root.add_module(name, load_graph(records))
            for name in saved["pieces"]:
                root.add_module(name, nn.Identity())  # replaced by its backend below
            split_gm = load_graph(saved["stitch"], root)
            loaded: dict[str, PiecewiseBackend] = {}
            for name, info in saved["pieces"].items():
                if info["sig"] not in loaded:
                    loaded[info["sig"]] = self._load_piece(name, info)
                split_gm.__dict__[name] = loaded[info["sig"]]
        except _Missing as exc:
            logger.warning("compile cache incomplete (%s): tracing again", exc)
            return None
        except Exception as exc:  # a stale or damaged record is a miss, never a crash
            logger.warning("saved graph unusable (%s: %s): tracing again",
                           type(exc).__name__, exc)
            return None
        compilation_counter.num_graphs_loaded += 1
        compilation_counter.num_piecewise_graphs_seen += len(saved["splitting"]) + len(
            saved["pieces"])
        compilation_counter.num_piecewise_capturable_graphs_seen += len(saved["pieces"])
        compilation_counter.num_unique_graphs += len(loaded)
        self.split_gm = split_gm
        self.direct = DirectCaller(split_gm, self.model, saved["recipe"])
        self.compile_time_s = time.perf_counter() - start
        return self.direct

    def _load_piece(self, name: str, info: dict[str, Any]) -> PiecewiseBackend:
        shapes = self.shapes if info["position"] is not None else self.shapes[-1:]
        runnables = {}
        for shape in shapes:
            fn = self.cache.load(self._artifact_name(info["sig"], shape), self.adaptor.load)
            if fn is None:
                raise _Missing(f"artifact for {name} at {shape}")
            runnables[shape] = fn
        return PiecewiseBackend(name, runnables, info["position"], info["returns_tuple"])


class _Missing(Exception):
    pass
