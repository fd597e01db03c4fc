"""The schemas and shape functions (fakes) of the `kiln_cpu` ops a graph calls.

They are defined here, in Python, rather than by the C++ library, so that a first start
can trace and compile its model while g++ still builds the library (kiln.ops.cpu_kernels):
the library only registers each op's CPU kernel. The ops that only install host state
(`set_amx`, `set_batch`, `clear_batch`) stay defined in C++, as catch-all kernels: no
graph calls them.
"""
from __future__ import annotations

import torch

SCHEMAS = (
    ("linear_packed(Tensor x, Tensor wp, Tensor? bias, Tensor? dense=None, "
     "int dense_from=0, Tensor? rows=None) -> Tensor"),
    ("linear_packed_silu(Tensor x, Tensor wp, Tensor? dense=None, int dense_from=0, "
     "Tensor? rows=None) -> Tensor"),
    ("linear_packed_rope(Tensor x, Tensor wp, Tensor? bias, Tensor positions, Tensor cos, "
     "Tensor sin, int rope_cols, Tensor? dense=None, int dense_from=0) -> Tensor"),
    ("linear_quant(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, "
     "int fmt, int panel_from, Tensor? rows=None) -> Tensor"),
    ("linear_quant_silu(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int fmt, "
     "int panel_from, Tensor? rows=None) -> Tensor"),
    ("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, "
     "Tensor indices) -> ()"),
    "apply_token_bitmask_(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()",
    "greedy_argmax(Tensor logits) -> Tensor",
    "silu_and_mul(Tensor x) -> Tensor",
    ("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) "
     "-> (Tensor, Tensor)"),
    "add_rms_norm(Tensor x, Tensor d, Tensor weight, float eps) -> (Tensor, Tensor)",
    # The scale comes with the batch (per layer), not as an argument: Dynamo may turn a
    # float module attribute into a symbolic input, which a C++ op cannot take. The layer
    # index is a one-element tensor (a buffer of the layer), not an int: an int would be
    # a constant in the graph, and the decoder layers could not share one compiled region.
    ("unified_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, "
     "Tensor layer_index) -> ()"),
)
_library: list[torch.library.Library] = []  # defined once per process, kept alive


def define_ops() -> None:
    """Define the schemas and register the fakes, once per process (before tracing a
    graph that calls them, or loading the library that implements them)."""
    if _library:
        return
    lib = torch.library.Library("kiln_cpu", "FRAGMENT")  # noqa: TOR901 (kept alive)
    for schema in SCHEMAS:
        lib.define(schema)
    _library.append(lib)
    _register_fakes()


def _register_fakes() -> None:

    @torch.library.register_fake("kiln_cpu::linear_packed")
    def _linear_packed_fake(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None,
                            dense: torch.Tensor | None = None, dense_from: int = 0,
                            rows: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::linear_packed_rope")
    def _linear_packed_rope_fake(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None,
                                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 rope_cols: int, dense: torch.Tensor | None = None,
                                 dense_from: int = 0) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::linear_packed_silu")
    def _linear_packed_silu_fake(x: torch.Tensor, wp: torch.Tensor,
                                 dense: torch.Tensor | None = None, dense_from: int = 0,
                                 rows: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], wp.shape[0] * 8))

    @torch.library.register_fake("kiln_cpu::linear_quant")
    def _linear_quant_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None, bias: torch.Tensor | None, fmt: int,
                           panel_from: int, rows: torch.Tensor | None = None
                           ) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::linear_quant_silu")
    def _linear_quant_silu_fake(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                                mins: torch.Tensor | None, fmt: int, panel_from: int,
                                rows: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0] * 8))

    @torch.library.register_fake("kiln_cpu::lora_add_")
    def _lora_add_fake(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, scaling: torch.Tensor,
                       indices: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::apply_token_bitmask_")
    def _apply_token_bitmask_fake(logits: torch.Tensor, rows: torch.Tensor,
                                  bitmask: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kiln_cpu::greedy_argmax")
    def _greedy_argmax_fake(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    @torch.library.register_fake("kiln_cpu::silu_and_mul")
    def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("kiln_cpu::rotary_embedding")
    def _rotary_embedding_fake(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("kiln_cpu::add_rms_norm")
    def _add_rms_norm_fake(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)
