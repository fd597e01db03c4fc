"""Example inputs for each piece, and a structural signature to find identical pieces."""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
from torch import fx


def record_piece_args(split_gm: fx.GraphModule, example_inputs: Sequence[Any]
                      ) -> dict[str, tuple[Any, ...]]:
    """Run the stitching graph on fake inputs (nothing real executes) and record the
    arguments every piece receives. The fake mode must be Dynamo's own: its fakes carry
    the symbolic token dimension."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import TracingContext

    fake_mode = TracingContext.get().fake_mode
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                 for a in example_inputs]
    recorded: dict[str, tuple[Any, ...]] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):  # type: ignore[override]
            recorded[target] = args
            return super().call_module(target, args, kwargs)

    with fake_mode, enable_python_dispatcher():
        Recorder(split_gm).run(*fake_args)
    return recorded


def graph_signature(gm: fx.GraphModule, args: Sequence[Any]) -> str:
    """Hash of a piece's structure and input metadata, blind to node and parameter names:
    the 30 decoder-layer pieces of a 30-layer model hash alike and compile once."""
    index: dict[fx.Node, str] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        rendered = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        if node.op == "placeholder":
            target = ""  # its name differs per layer; its position and metadata do not
        elif node.op == "get_attr":
            target = _attr_key(_attr(gm, node.target))
        else:
            target = node.target
        lines.append(f"{node.op} {_name(target)} {rendered}")
    lines.extend(_describe(a) for a in args)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _attr_key(obj: Any) -> str:
    """A compiled region's body by its structure (the same code in every process, so its
    artifact keeps its name); any other attribute by identity (distinct constants never
    merge)."""
    if isinstance(obj, fx.GraphModule):
        return f"graph@{graph_signature(obj, ())}"
    return f"attr@{id(obj)}"


def _attr(gm: fx.GraphModule, path: str) -> Any:
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _name(target: Any) -> str:
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    qualname = getattr(target, "__qualname__", None) or repr(target)
    return f"{getattr(target, '__module__', None) or ''}.{qualname}"


def _describe(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        return f"T{tuple(str(s) for s in arg.shape)}{tuple(str(s) for s in arg.stride())}" \
               f"{arg.dtype}{arg.device.type}"
    if isinstance(arg, torch.SymInt):
        return "SymInt"
    return repr(arg)


def returns_tuple(gm: fx.GraphModule) -> bool:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def token_dim_position(args: Sequence[Any]) -> tuple[str, int] | None:
    """Where a piece finds the runtime token count: a SymInt argument, else the first
    tensor whose dim 0 is symbolic. None for a piece with fully static inputs."""
    for i, a in enumerate(args):
        if isinstance(a, torch.SymInt):
            return "int", i
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.dim() and isinstance(a.shape[0], torch.SymInt):
            return "tensor", i
    return None


def concrete_args(args: Sequence[Any], size: int) -> list[Any]:
    """Fake inputs with the token dimension fixed to `size` (for static-shape builds)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.SymInt):
            out.append(size)
        elif isinstance(a, torch.Tensor):
            shape = [size if isinstance(d, torch.SymInt) else int(d) for d in a.shape]
            with mode:
                out.append(torch.empty(shape, dtype=a.dtype, device=a.device))
        else:
            out.append(a)
    return out
