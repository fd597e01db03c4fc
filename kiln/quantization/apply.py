"""Turn a loaded float model into the quantized one its QuantizationConfig names."""
from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from kiln.quantization.config import QuantizationConfig
from kiln.quantization.methods import QuantizedLinearMethod, format_name, install
from kiln.quantization.packing import packable_shape, quantize_int8

logger = logging.getLogger(__name__)


def default_panel_from() -> int:
    """Rows from which the quantized kernel's panel path runs, without a tuning table.
    Measured (`kiln bench kernels --ops linear_quant`, SmolLM2's shapes, 2 threads): on
    AVX512-BF16 the bf16 panel beats the direct kernel from 8 rows (1.3-2x at 32-128);
    on the FMA-only classes the fp32 panel never beat it, so it stays off there."""
    from kiln.ops import cpu_kernels

    return 8 if cpu_kernels.loaded() and cpu_kernels.isa_class() in ("amx", "avx512_bf16") \
        else 0


def _owners(model: nn.Module) -> Counter[int]:
    return Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))


def apply_quantization(model: nn.Module, qc: QuantizationConfig) -> str:
    """Quantize `model`'s linears in place as `qc` says; returns the start-up summary."""
    from kiln.models.layers import Linear

    if qc.method is None:
        return qc.describe()
    owners = _owners(model)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    notes: list[str] = []
    if qc.method == "int8":
        weights = {name: quantize_int8(m.weight) for name, m in linears.items()
                   if packable_shape(*m.weight.shape)}
    else:
        from kiln.quantization.gguf_weights import gguf_linears

        weights, notes = gguf_linears(model, qc.gguf_path)
    method = QuantizedLinearMethod(qc.method)
    panel_from = default_panel_from()
    for name, w in weights.items():
        layer = linears[name]
        install(layer, w, method, release_float=owners[id(layer.weight)] == 1)
        layer.panel_from = panel_from
    for note in notes:
        logger.warning(note)
    kept = [n for n in linears if n not in weights]
    formats = Counter(format_name(m) for m in linears.values())
    summary = (f"{qc.describe()}: linear layers {dict(formats)}"
               + (f"; float: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}"
                  if kept else ""))
    return summary


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of every quantized linear weight (codes, scales, offsets)."""
    total = 0
    for buf_name, buf in model.named_buffers():
        if buf_name.rsplit(".", 1)[-1] in ("qcodes", "qscales", "qmins"):
            total += buf.numel() * buf.element_size()
    return total


__all__ = ["apply_quantization", "default_panel_from", "quantized_bytes"]
