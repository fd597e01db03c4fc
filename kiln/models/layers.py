"""Shared layers for Llama-family decoders, written to match transformers numerically."""
from __future__ import annotations

import math

import torch
from torch import nn

from kiln.ops.linear import linear, linear_rope, linear_silu
from kiln.ops.lora import add_lora
from kiln.ops.pointwise import (add_rms_norm, add_rms_norm_applies, rope_kernel_applies,
                                rotary_neox, silu_and_mul)


class LinearMethod:
    """The unquantized GEMM over `layer.weight`."""

    quantized = False
    name = "unquantized"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        return linear(x, layer.weight, bias, layer.packed_weight, layer.dense_from,
                      layer.kept_rows)

    def silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul of the GEMM without bias; over a packed weight one kernel
        (kiln.ops.linear.linear_silu)."""
        wp = layer.packed_weight
        if wp is not None and wp.shape[0] % 2 == 0:
            return linear_silu(x, layer.weight, wp, layer.dense_from, layer.kept_rows)
        return silu_and_mul(self.apply(layer, x, None))


# Every Linear's method until quantization installs another (kiln.quantization.methods).
UNQUANTIZED = LinearMethod()


class Linear(nn.Linear):
    """nn.Linear whose GEMM is its `quant_method`'s: the float weight (UNQUANTIZED),
    prepacked or not (`kiln.models.packing.pack_linears`), or a quantized one
    (kiln.quantization.methods). With
    LoRA on, each token then adds its adapter's update (kiln.ops.lora)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        # A buffer, so the traced graph names it like the weight (a warm start rebuilds
        # the graph from module paths); not persistent, as checkpoints hold `weight`.
        self.register_buffer("packed_weight", None, persistent=False)
        self.dense_from = 0  # rows from which F.linear on `weight` runs (the plan's choice)
        # A quantized weight (kiln.ops.quant_packing.QuantWeight), installed at load.
        for name in ("qcodes", "qscales", "qmins"):
            self.register_buffer(name, None, persistent=False)
        self.qfmt = -1
        self.panel_from = 0  # rows from which the quantized kernel's panel path runs
        self.quant_method = UNQUANTIZED
        # LoRA slots (kiln.lora.layers.install_slots), when the engine enables LoRA.
        for name in ("lora_a", "lora_b", "lora_scaling", "lora_indices"):
            self.register_buffer(name, None, persistent=False)
        # Which rows of the output anyone reads (the kernels' hint, csrc/kept_rows.h), set
        # by the runner (kiln.runner.kept_rows) on the linears after each attention: its
        # per-step buffer in the last layer, a constant "every row" in the others; None
        # (every row) in every other linear and in a model the runner leaves alone.
        self.register_buffer("kept_rows", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_lora(self, self.quant_method.apply(self, x, self.bias), x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(self(x)) for a [gate | up] projection: the method's fused kernel
        where the layer is its GEMM alone (no bias, no adapter), the same bits either way."""
        if self.bias is None and self.lora_a is None:
            return self.quant_method.silu_and_mul(self, x)
        return silu_and_mul(self(x))

    def rope_fusable(self, x: torch.Tensor, rotary: RotaryEmbedding) -> bool:
        """Whether `with_rope` is one kernel for x: the unquantized GEMM over a packed
        weight, no adapter (it adds to the product before RoPE), kiln's RoPE kernel."""
        return (not self.quant_method.quantized and self.packed_weight is not None
                and self.lora_a is None and rope_kernel_applies(x, rotary.cos))

    def with_rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                  rope_cols: int) -> torch.Tensor:
        """self(x) with `rotary` applied to its first rope_cols columns (heads of its head
        size): one kernel, where `rope_fusable` said so (kiln.ops.linear.linear_rope)."""
        return linear_rope(x, self.weight, self.bias, self.packed_weight, self.dense_from,
                           positions, rotary.cos, rotary.sin, rope_cols)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype (the reference's rounding points).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward_add(self, x: torch.Tensor, d: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, self(x + d)): a residual add and the norm after it. bf16 on the CPU is
        one kernel (kiln_cpu::add_rms_norm, threaded at prefill sizes: Inductor builds its
        fused kernels single-threaded on small hosts, kiln/compiler/build.py)."""
        if add_rms_norm_applies(x, d, self.weight):
            return add_rms_norm(x, d, self.weight, self.eps)
        h = x + d
        return h, self(h)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a precomputed [max_positions, head_dim] cos/sin cache."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the float32 cos/sin cache; models built on `meta` call this once
        they have real storage."""
        inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1).to(self.cos.device)
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, hd], k: [T, kv_heads, hd]
        return rotary_neox(positions, q, k, self.cos, self.sin)


def _inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class SiluAndMul(nn.Module):
    """[T, 2 * I] (gate | up) -> [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


# A model's layers differ only in their weights, so Dynamo traces one layer and Inductor
# compiles it once; every layer then calls the same compiled code. A layer whose Python
# differs (a MoE layer among dense ones, another rope type) is traced again as its own
# region; the bound is high enough that this never fails, it only compiles more.
@torch.compiler.nested_compile_region(max_reuse_entries=1024)
def _layer_region(layer: nn.Module, positions: torch.Tensor, h: torch.Tensor,
                  delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(positions, h, delta)


class DecoderLayers(nn.ModuleList):
    """The decoder stack, `forward(positions, h) -> h`.

    A layer is `forward(positions, h, delta) -> (h, delta)`: the residual stream is
    h + delta, and a layer returns its last branch (the MLP's output) as the next delta
    instead of adding it itself, so the add fuses into the next layer's first norm (one
    kernel, not two: a layer is a compile region, which a fusion cannot cross). The first
    layer gets a zero delta; the stack's end adds the last one. The same adds in the same
    order as `h = h + mlp(...)`: the numbers do not change.

    `regional` (set by the compiler before tracing; a no-op in eager mode) makes each
    layer's call a nested compile region. It is only set where the graph is not split at
    attention (a split cannot cut inside a region) and attention takes its layer as a
    tensor (an int would be a per-layer constant, and no two layers would match)."""

    regional = False

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        delta = torch.zeros_like(h)
        for layer in self:
            h, delta = (_layer_region(layer, positions, h, delta) if self.regional
                        else layer(positions, h, delta))
        return h + delta


def set_regions(model: nn.Module, on: bool) -> None:
    for module in model.modules():
        if isinstance(module, DecoderLayers):
            module.regional = on
