"""`kiln bench kernels --ops linear`: the candidates for each weight matmul of a model.

One case per (layer shape, row count): the model's fused QKV, attention output, fused
gate|up, down and lm_head projections, at every decode batch size and prefill length.
Candidates, each on a weight laid out once beforehand (never per call):

  F.linear          PyTorch's GEMM on the plain weight (oneDNN/MKL; the reference)
  kiln-packed       kiln's packed-tile kernel (bf16; AMX, AVX512-BF16, or AVX512 or AVX2 FMAs)
  kiln-packed-regs  the same with AMX tiles off (AMX hosts only): the row count from which
                    tiles run is chosen from these two (linear_plan.amx_from_times)
  onednn-prepacked  oneDNN's own prepacked layout (`mkldnn._reorder_linear_weight`);
                    bf16 only where oneDNN runs bf16 natively (not on AVX2-only hosts)
  inductor-autotune Inductor max-autotune with freezing: its CPU GEMM templates vs aten
                    (with `compiled`: one compile per shape, so it is slow to tune)

The engine applies the winners per layer (kiln/ops/linear_plan.py): it can run
`kiln-packed` and `F.linear`, so those two decide where a layer switches between them;
the others are measured so a host where they win is visible in the table.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from kiln.bench.cases import Candidate, Case, Shapes, close
from kiln.ops import cpu_kernels, cpu_paths
from kiln.ops.linear import linear, pack
from kiln.ops.linear_plan import PACKED, REGS
from kiln.ops.tuning import shape_key


def layer_shapes(s: Shapes) -> dict[str, tuple[int, int]]:
    """Layer kind -> (out_features, in_features), as kiln's Llama-family layers fuse them."""
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return {"qkv_proj": (qkv, s.hidden), "o_proj": (s.hidden, s.num_heads * s.head_dim),
            "gate_up_proj": (2 * s.intermediate, s.hidden),
            "down_proj": (s.hidden, s.intermediate), "lm_head": (s.vocab, s.hidden)}


def linear_key(rows: int, n: int, k: int, dtype: torch.dtype) -> str:
    return shape_key(rows=rows, n=n, k=k, dtype=dtype)


def _onednn_prepacked(w: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _inductor_autotune(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch._inductor.config as inductor_config

    module = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    module.weight.data = w
    module.eval().requires_grad_(False)
    with inductor_config.patch(freezing=True):
        fn = torch.compile(module, mode="max-autotune-no-cudagraphs", dynamic=False)

    def run(x: torch.Tensor) -> torch.Tensor:
        with inductor_config.patch(freezing=True):
            return fn(x)

    return run


def linear_cases(s: Shapes, compiled: bool) -> list[Case]:
    if s.device.type != "cpu":
        return []  # on CUDA the matmuls are cuBLAS's or Inductor's, tuned by -O3
    g = torch.Generator().manual_seed(0)
    onednn_prepack = (s.dtype != torch.bfloat16
                      or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    cases = []
    for kind, (n, k) in layer_shapes(s).items():
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(s.dtype)
        wp = pack(w) if s.dtype == torch.bfloat16 and cpu_kernels.loaded() else None
        for rows in s.token_counts:
            x = torch.randn(rows, k, generator=g).to(s.dtype)
            cands = [Candidate("F.linear", lambda x=x, w=w: F.linear(x, w))]
            if wp is not None:
                cands.append(Candidate(PACKED, lambda x=x, w=w, wp=wp: linear(x, w, None, wp)))
            if wp is not None and cpu_paths.amx_active():
                cands.append(Candidate(REGS, lambda x=x, w=w, wp=wp: _without_tiles(x, w, wp)))
            extra: list[tuple[str, Callable[[], Any]]] = []
            if onednn_prepack:
                extra.append(("onednn-prepacked",
                              lambda w=w, rows=rows: _onednn_prepacked(w, rows)))
            if compiled:
                extra.append(("inductor-autotune", lambda w=w: _inductor_autotune(w)))
            cands += [Candidate(name, _deferred(make, x)) for name, make in extra]
            tol = 1e-4 if s.dtype == torch.float32 else 2e-2
            cases.append(Case("linear", linear_key(rows, n, k, s.dtype), cands,
                              compare=lambda a, b, tol=tol: close(a, b, tol)))
    return cases


def _without_tiles(x: torch.Tensor, w: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    with cpu_paths.linear_tiles_off():
        return linear(x, w, None, wp)


def _deferred(make: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
              x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A candidate whose set-up (packing, compiling) runs on its first call, so one that
    cannot be built here fails as a reported candidate, not while the cases are listed."""
    built: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def run() -> torch.Tensor:
        if not built:
            built.append(make())
        return built[0](x)

    return run
