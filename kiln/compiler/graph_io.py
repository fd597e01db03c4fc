"""Save and restore a traced FX graph without Dynamo, plus how to feed it.

A warm start rebuilds the traced graph from this record instead of running Dynamo again
(which costs seconds per start on a 30-layer model), and every call after start-up feeds
the split graph directly: no Dynamo frame hook on the hot path.

What is saved is the split result: the stitching graph (placeholders in Dynamo's order,
calls to the pieces) and the graphs of the splitting pieces; compiled pieces come back as
their cached artifacts. Re-splitting a rebuilt graph is avoided on purpose: the split
depends on symbolic-shape metadata that only a Dynamo trace carries. Nodes are recorded
with their targets by import path; a graph holding anything this format cannot name
faithfully (tensor constants, lambdas) is simply not saved, and the engine keeps using
Dynamo.
"""
from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn


class NotSerializable(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Ref:
    name: str


# ---- targets ------------------------------------------------------------------------------
def _target_ref(node: fx.Node) -> Any:
    target = node.target
    if node.op in ("call_method", "call_module", "placeholder", "output"):
        return target
    if node.op != "call_function":
        raise NotSerializable(f"{node.op} node {node.name}")
    if isinstance(target, torch._ops.OpOverload):
        ref = ("op", target._schema.name, target._overloadname)
    else:
        ref = ("fn", getattr(target, "__module__", None), getattr(target, "__name__", None))
    if _resolve(ref) is not target:
        raise NotSerializable(f"cannot name {target!r} by import path")
    return ref


def _resolve(ref: Any) -> Any:
    kind, a, b = ref
    if kind == "op":
        ns, name = a.split("::")
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, b or "default")
    try:
        return getattr(importlib.import_module(a), b)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


# ---- graphs -------------------------------------------------------------------------------
def check_single_output(gm: fx.GraphModule) -> None:
    """DirectCaller returns the one hidden-state tensor; refuse anything else."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)) and len(output.args[0]) != 1:
        raise NotSerializable("the graph returns several values")


def dump_graph(gm: fx.GraphModule) -> list[tuple]:
    records = []
    for node in gm.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(n.name))
        records.append((node.op, node.name, _target_ref(node), args))
    pickle.dumps(records)  # fail now, not at save time, on an unpicklable constant
    return records


def load_graph(records: list[tuple], root: nn.Module | None = None) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def deref(value: Any) -> Any:
        if isinstance(value, _Ref):
            return env[value.name]
        if isinstance(value, (list, tuple)):
            return type(value)(deref(v) for v in value)
        if isinstance(value, dict):
            return {k: deref(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(deref(value.start), deref(value.stop), deref(value.step))
        return value

    for op, name, target, (args, kwargs) in records:
        args, kwargs = deref(args), deref(kwargs)
        if op == "output":
            graph.output(args[0])
            continue
        real = _resolve(target) if op == "call_function" else target
        env[name] = graph.create_node(op, real, args, kwargs, name=name)
    return fx.GraphModule(root or nn.Module(), graph)


# ---- inputs -------------------------------------------------------------------------------
InputRecipe = list[tuple[str, Any]]  # ("param", name) | ("input", 0|1) | ("size", None)


def input_recipe(model: nn.Module, example_inputs: Sequence[Any],
                 inputs: Sequence[torch.Tensor]) -> InputRecipe:
    """Where each flat graph input comes from, found by identity."""
    named = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    recipe: InputRecipe = []
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            recipe.append(("size", None))
        elif any(value is t for t in inputs):
            recipe.append(("input", next(i for i, t in enumerate(inputs) if value is t)))
        elif isinstance(value, torch.Tensor) and id(value) in named:
            recipe.append(("param", named[id(value)]))
        else:
            raise NotSerializable(f"graph input of type {type(value).__name__} has no source")
    return recipe


class DirectCaller:
    """Call the split graph with flat inputs assembled from a recipe, skipping Dynamo."""

    def __init__(self, split_gm: fx.GraphModule, model: nn.Module, recipe: InputRecipe) -> None:
        tensors = dict([*model.named_parameters(), *model.named_buffers()])
        self.split_gm = split_gm
        self.template = [tensors[src] if kind == "param" else None for kind, src in recipe]
        self.slots = [(i, kind, src) for i, (kind, src) in enumerate(recipe) if kind != "param"]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = list(self.template)
        inputs = (input_ids, positions)
        for i, kind, src in self.slots:
            args[i] = inputs[src] if kind == "input" else input_ids.shape[0]
        out = self.split_gm(*args)
        return out[0] if isinstance(out, (tuple, list)) else out

