"""Build a model from a Hugging Face directory: skeleton on `meta`, then weights.

Each checkpoint tensor goes to the `weight_loader` of the module owning its parameter
(default: a checked copy) as a lazy `CheckpointTensor`, so fused parameters take their
shards, and under tensor parallelism a rank reads only its slice of each tensor.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kiln.models.linear import CheckpointTensor, copy_checked
from kiln.models.model_config import ModelConfig
from kiln.models.registry import model_class

logger = logging.getLogger(__name__)
# Per-layer tensors of pre-quantized checkpoints (compressed-tensors W8A16).
QUANT_METADATA = (".weight_scale", ".weight_zero_point")


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                progress: bool = True) -> nn.Module:
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    load_weights(model, cfg.path, progress)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, path: Path, progress: bool = True) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(path)!r} has no *.safetensors files; kiln loads "
                         "safetensors checkpoints (convert .bin with transformers' "
                         "save_pretrained(safe_serialization=True))")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    bar = tqdm(files, desc="loading weights", unit="file", disable=not progress or len(files) < 2)
    for file in bar:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = model.checkpoint_name(name)
                if target is None:
                    continue
                pname, shard = target
                if pname.endswith(QUANT_METADATA):
                    continue  # read by kiln.quantization (prequantized.py)
                if pname not in params:
                    logger.warning("checkpoint tensor %s has no parameter in %s; skipped",
                                   name, type(model).__name__)
                    continue
                param = params[pname]
                weight = CheckpointTensor(f, name, param.dtype)
                owner = model.get_submodule(pname.rpartition(".")[0])
                getattr(owner, "weight_loader", _copy)(param, weight, shard)
                loaded.add(pname)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks weights for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")


def _copy(param: nn.Parameter, weight: CheckpointTensor, shard: str | None) -> None:
    copy_checked(param, weight.full())
