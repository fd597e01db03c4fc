"""Cut a Dynamo graph at its splitting ops (attention) into piecewise subgraphs.

L attention layers give 2L+1 pieces: L+1 compiled pieces between them and L splitting
pieces that run eagerly. A `getitem` stays with the node that produced its tuple, and
`x.size()` tuples are decomposed into per-dimension sizes first, so no tuple ever
crosses a piece boundary (standalone compilation needs flat inputs).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx
from torch.fx.passes.split_module import split_module


@dataclass(frozen=True, slots=True)
class SplitItem:
    name: str  # attribute name of the piece in the stitching module ("submod_3")
    graph_id: int
    is_splitting: bool
    graph: fx.GraphModule


def op_name(node: fx.Node) -> str | None:
    """'ns::op' for calls to torch ops, else None."""
    target = node.target
    if node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name  # "ns::op"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]
                ) -> tuple[fx.GraphModule, list[SplitItem]]:
    _decompose_size_tuples(gm)
    ops = set(splitting_ops)
    assignment: dict[fx.Node, int] = {}
    piece, splitting_ids = 0, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if (node.op == "call_function" and node.target is operator.getitem
                and node.args[0].op != "placeholder"):
            assignment[node] = assignment[node.args[0]]
        elif op_name(node) in ops:
            piece += 1
            assignment[node] = piece
            splitting_ids.add(piece)
            piece += 1
        else:
            assignment[node] = piece
    split_gm = split_module(gm, None, lambda n: assignment[n], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, graph_id, graph_id in splitting_ids, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items


def _decompose_size_tuples(gm: fx.GraphModule) -> None:
    """Rewrite `getitem(x.size(), i)` into `aten.sym_size.int(x, i)`."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_method" and node.target == "size" and len(node.args) == 1
                and not node.kwargs):
            continue
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                with gm.graph.inserting_before(user):
                    dim = gm.graph.call_function(torch.ops.aten.sym_size.int,
                                                 (node.args[0], user.args[1]))
                dim.meta.update(user.meta)
                user.replace_all_uses_with(dim)
                gm.graph.erase_node(user)
        if not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
