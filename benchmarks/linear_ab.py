"""Two builds of kiln's packed linear side by side in one process, interleaved, on a
model's linear shapes, with PyTorch's fp32 and bf16 (oneDNN) GEMMs beside them:

    python benchmarks/linear_ab.py OLD_CSRC [NEW_CSRC] [--rows 1 8 32 128 512]
        [--layers qkv_proj o_proj gate_up_proj down_proj lm_head]

OLD_CSRC / NEW_CSRC are kiln/ops/csrc directories (e.g. from `git worktree add /tmp/old
HEAD~1`; NEW defaults to this checkout's). Each build is compiled for this host's ISA
class under its own operator namespace (kiln_ab0, kiln_ab1), so both load at once and
their samples alternate: on a noisy machine an A/B in one process is the fair one. Every
output is checked against an fp32 reference before it is timed. `--layers` keeps only the
named layer kinds: at prefill row counts the lm_head (a prefill samples one row of it) and
its fp32 reference take most of the run.
"""
from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kiln.bench.cases_linear import layer_shapes
from kiln.bench.shapes import model_shapes
from kiln.ops import cpu_kernels
from kiln.ops.cpu_fakes import SCHEMAS
from kiln.ops.linear import pack

HERE = Path(__file__).resolve().parents[1] / "kiln" / "ops" / "csrc"
_libraries: list[torch.library.Library] = []  # the renamed schemas, kept alive


def build(csrc: Path, namespace: str) -> Callable[..., torch.Tensor]:
    """linear_bf16.cpp from `csrc` (with pointwise.cpp, whose SiLU it calls, where it
    has one), its library renamed to `namespace`, built and loaded."""
    from torch.utils.cpp_extension import load

    names = [n for n in ("linear_bf16.cpp", "pointwise.cpp") if (csrc / n).exists()]
    sources = {n: _renamed((csrc / n).read_text(), namespace) for n in names}
    if 'm.def("linear_packed' not in sources["linear_bf16.cpp"]:  # the schemas are Python's
        _libraries.append(torch.library.Library(namespace, "FRAGMENT"))
        for schema in SCHEMAS if len(names) > 1 else SCHEMAS[:1]:
            _libraries[-1].define(schema)
    digest = hashlib.sha256("".join(sources.values()).encode()).hexdigest()[:12]
    work = Path(tempfile.gettempdir()) / f"kiln_linear_ab_{namespace}_{digest}"
    work.mkdir(exist_ok=True)
    for header in csrc.glob("*.h"):
        (work / header.name).write_bytes(header.read_bytes())
    for name, source in sources.items():
        (work / name).write_text(source)
    flags = cpu_kernels.cflags(cpu_kernels.isa_class())
    load(f"{namespace}_ops", sources=[str(work / n) for n in names], extra_cflags=flags,
         extra_ldflags=["-fopenmp"], build_directory=str(work), is_python_module=False)
    ops = getattr(torch.ops, namespace)
    if cpu_kernels.isa_class() == "amx" and torch.cpu._init_amx():
        ops.set_amx(True, 1)  # tiles from one row on: the path large batches take
    op = ops.linear_packed
    return lambda x, wp: op(x, wp, None, None, 0)


def _renamed(source: str, namespace: str) -> str:
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        source = source.replace(f"{macro}(kiln_cpu,", f"{macro}({namespace},")
    return source


def per_call_ms(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="?", default=HERE)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32, 64, 128, 512])
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--layers", nargs="+", default=None, help="layer kinds (default: all)")
    args = ap.parse_args()
    if cpu_kernels.host_supports() is not None:
        raise SystemExit(f"kiln's kernels cannot run here: {cpu_kernels.host_supports()}")
    kinds = layer_shapes(model_shapes(args.model, "bfloat16", "cpu", [1], [1], 1))
    if unknown := set(args.layers or ()) - set(kinds):
        raise SystemExit(f"--layers: unknown {sorted(unknown)}; the kinds are {list(kinds)}")
    builds = [build(args.old, "kiln_ab0"), build(args.new, "kiln_ab1")]
    g = torch.Generator().manual_seed(0)
    print(f"ISA class {cpu_kernels.isa_class()}, {torch.get_num_threads()} threads, "
          f"min of {args.samples} interleaved samples")
    print(f"{'layer':<14} {'rows':>5} {'old ms':>9} {'new ms':>9} {'fp32 ms':>9} "
          f"{'bf16 ms':>9} {'new/old':>8} {'new/fp32':>8} {'new/bf16':>8}")
    for kind, (n, k) in kinds.items():
        if args.layers and kind not in args.layers:
            continue
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        wp, wf = pack(w), w.float()
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            xf = x.float()
            ref = F.linear(xf, wf)
            for run in builds:
                err = (run(x, wp).float() - ref).abs().max() / ref.abs().max()
                assert err < 1e-2, f"{kind} rows={rows}: relative error {err}"
            fns = [lambda run=run: run(x, wp) for run in builds] + [lambda: F.linear(xf, wf),
                                                                    lambda: F.linear(x, w)]
            iters = max(2, int(1e8 / (rows * n * k + 1e6)))
            samples: list[list[float]] = [[] for _ in fns]
            for _ in range(args.samples):  # interleaved: old, new, fp32, bf16, old, ...
                for times, f in zip(samples, fns):
                    times.append(per_call_ms(f, iters))
            a, b, c, d = (min(times) for times in samples)
            print(f"{kind:<14} {rows:>5} {a:>9.3f} {b:>9.3f} {c:>9.3f} {d:>9.3f} {a / b:>7.2f}x "
                  f"{c / b:>7.2f}x {d / b:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
