"""Turn a loaded float model into the quantized one its QuantizationConfig names."""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from kiln.config.quantization import QuantizationConfig
from kiln.ops import cpu_kernels
from kiln.ops.linear import param_owners
from kiln.ops.quant_packing import (FORMAT_NAMES, Q4, Q8, QuantWeight, packable_shape,
                                    quantize_fp8, quantize_int8, quantize_int8_groups)
from kiln.quantization.methods import QuantizedLinearMethod, format_name, install
from kiln.quantization.plan import layer_panel_from, load_panel_plans

logger = logging.getLogger(__name__)


def apply_quantization(model: nn.Module, qc: QuantizationConfig,
                       dtype: torch.dtype = torch.bfloat16) -> str:
    """Quantize `model`'s linears in place as `qc` says; each layer's panel row count
    comes from the tuning table for `dtype` (activations), else the ISA default.
    Returns the start-up summary."""
    from kiln.models.layers import Linear

    if qc.method is None and not qc.prequantized:
        return qc.describe()
    owners = param_owners(model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    notes: list[str] = []
    if qc.prequantized:
        from kiln.quantization.prequantized import apply_prequantized

        weights = apply_prequantized(model, model.config.path, qc.method is not None)
        if qc.method is None:
            return f"{qc.describe()} (the int8 checkpoint dequantized at load)"
    elif qc.method in ("int8", "int8-channel", "fp8"):
        quantize = {"int8": quantize_int8_groups, "int8-channel": quantize_int8,
                    "fp8": quantize_fp8}[qc.method]
        weights = {name: quantize(m.weight) for name, m in linears.items()
                   if packable_shape(*m.weight.shape)}
    else:
        from kiln.quantization.gguf_weights import gguf_linears

        weights, notes = gguf_linears(model, qc.gguf_path)
    method = QuantizedLinearMethod(qc.method)
    plans = load_panel_plans(dtype)
    for name, w in weights.items():
        layer = linears[name]
        install(layer, w, method, release_float=owners[id(layer.weight)] == 1)
        layer.panel_from = layer_panel_from(w.fmt, plans.get((FORMAT_NAMES[w.fmt], *w.shape)))
    for note in notes:
        logger.warning(note)
    kept = [n for n in linears if n not in weights]
    formats = Counter(format_name(m) for m in linears.values())
    summary = (f"{qc.describe()}: linear layers {dict(formats)}"
               + _activation_note(weights, dtype)
               + (f"; float: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}"
                  if kept else ""))
    return summary


def _activation_note(weights: dict[str, QuantWeight], dtype: torch.dtype) -> str:
    """Where the kernels quantize activations, the start-up line says so: the direct Q4
    kernel of the AVX512-BF16 and AVX2 builds, and the direct Q8 kernel (GGUF Q8_0 and
    `int8`'s group format) of the VNNI builds, take bf16 x as int8 per 32 columns
    (llama.cpp's Q8_1 / Q8_0 dots)."""
    fmts = {w.fmt for w in weights.values()}
    names = [name for fmt, name, on in ((Q4, "Q4", cpu_kernels.q4_int8_activations()),
                                        (Q8, "Q8", cpu_kernels.q8_int8_activations()))
             if on and fmt in fmts]
    if dtype != torch.bfloat16 or not names:
        return ""
    return (f"; {'/'.join(names)} layers' rows below each layer's panel row count (decode; "
            "every row where the panel is off) quantize the bf16 activations to int8 per 32 "
            "columns, as llama.cpp does; panel rows and float32 runs use them unquantized")
