"""Pre-quantized HF checkpoints (compressed-tensors W8A16, per channel).

The loader reads each int8 weight into the layer's float parameter as its codes (exact:
|q| <= 127 fits bf16 and fp32) and skips the `*.weight_scale` tensors; this module reads
those scales, sliced like the weights (a column-parallel layer takes its shards' rows,
a row-parallel one its whole rows), and either packs the codes with them (int8-channel)
or multiplies them in (`--quantization none`: dequantized at load). A layer the
checkpoint left unquantized (no scale, e.g. the lm_head in its `ignore` list) stays float.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kiln.distributed.parallel_state import tp_rank
from kiln.ops.quant_packing import QuantWeight, pack_int8, packable_shape


def read_scales(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """{module name: fp32 per-row scales [local rows]} for every layer that has them."""
    from kiln.models.layers import Linear

    found: dict[str, dict[str | None, torch.Tensor]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(".weight_scale"):
                    continue
                target = model.checkpoint_name(name.removesuffix("_scale"))
                if target is None:
                    continue
                module = target[0].rpartition(".")[0]
                found.setdefault(module, {})[target[1]] = \
                    f.get_tensor(name).reshape(-1).float()
    scales = {}
    for module, parts in found.items():
        layer = model.get_submodule(module)
        if not isinstance(layer, Linear):
            continue
        shards = getattr(layer, "shards", None)
        if shards:  # column-parallel: each shard's rows of this rank, in row order
            scales[module] = torch.cat([parts[k][s.src_start: s.src_start + s.rows]
                                        for k, s in shards.items()])
        else:  # row-parallel (whole rows) or the vocab-parallel lm_head (this rank's)
            rows = layer.weight.shape[0]
            start = tp_rank() * rows if hasattr(layer, "vocab_size") else 0
            s = parts[None][start: start + rows]
            scales[module] = torch.cat([s, s.new_ones(rows - len(s))])  # padded vocab rows
    return scales


def apply_prequantized(model: nn.Module, path: Path, keep_quantized: bool
                       ) -> dict[str, QuantWeight]:
    """{module name: packed weight} for the layers with scales (`keep_quantized`), or
    none after multiplying the scales into the float weights (dequantized at load)."""
    weights = {}
    for name, s in read_scales(model, path).items():
        layer = model.get_submodule(name)
        if keep_quantized and packable_shape(*layer.weight.shape):
            weights[name] = pack_int8(layer.weight.detach().round(), s)
        else:
            layer.weight.data.mul_(s[:, None].to(layer.weight.dtype))
    return weights
