"""QuantizationConfig: which quantization a model runs with (resolved at start-up by
`kiln.quantization.resolve`), and the names of the methods and GGUF formats."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# int8: weight-only, symmetric, per output channel with one scale per 32 input columns;
# int8-channel: one scale per output channel (measured +1.8% perplexity on SmolLM2 vs
# -0.9% for int8's groups: docs/quantization.md).
# fp8: float8 e4m3 weights, a scale per output channel, on CUDA (Triton kernel).
METHODS = ("int8", "int8-channel", "fp8", "gguf")
CHOICES = ("none", *METHODS)
# GGUF tensor types kept in their block format and dequantized inside kiln's kernel.
GGUF_NATIVE = ("Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """`method` None runs the weights in the activation dtype. `source` says who asked
    (for messages); `gguf_path` is the file whose blocks the gguf method loads;
    `gguf_types` counts the file's tensor types (for the start-up line)."""

    method: str | None = None
    source: str = "default"
    gguf_path: Path | None = None
    gguf_types: dict[str, int] = field(default_factory=dict)
    # The checkpoint holds int8 codes and scales (compressed-tensors W8A16): the weights
    # load as their codes and `kiln.quantization.prequantized` applies the scales.
    prequantized: bool = False

    def cache_key(self) -> dict[str, object]:
        """What changes compiled code: the method (the per-layer formats are in the
        linear-plan signature)."""
        return {"method": self.method}

    def describe(self) -> str:
        if self.method is None:
            return "none (weights in the activation dtype)"
        if self.method == "int8":
            return ("int8 (weight-only, symmetric per output channel with a scale per 32 "
                    "input columns, made at load)")
        if self.method == "fp8":
            return "fp8 (float8 e4m3 weights, a scale per output channel, made at load)"
        if self.method == "int8-channel":
            return "int8-channel (weight-only, symmetric, one scale per output channel)"
        types = ", ".join(f"{t} x{n}" for t, n in sorted(self.gguf_types.items()))
        return f"gguf (block formats kept; file tensors: {types})"
