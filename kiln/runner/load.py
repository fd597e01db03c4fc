"""The runner's first start-up step: the model's weights in memory as steps read them."""
from __future__ import annotations

import logging

import torch
from torch import nn

from kiln import envs
from kiln.compiler.cache import default_cache_root
from kiln.config.quantization import QuantizationConfig
from kiln.models.loader import build_model
from kiln.models.model_config import ModelConfig
from kiln.models.packing import pack_cpu_weights
from kiln.ops import cpu_kernels
from kiln.quantization.apply import apply_quantization
from kiln.runner.huge_pages import move_weights_to_huge_pages

logger = logging.getLogger(__name__)


def load_weights(model_config: ModelConfig, quantization: QuantizationConfig,
                 dtype: torch.dtype, device: torch.device, progress: bool) -> nn.Module:
    """Build the model, quantize it, pack bf16 weights for kiln's CPU kernels and move
    them to huge pages. Order matters: the kernels are loaded, or planned on while they
    build, before anything is traced (whether the graph calls them is decided at trace
    time), and huge pages come last (the packed copies are what steps read)."""
    if device.type == "cpu":
        cpu_kernels.ensure_planned(default_cache_root(), progress)
    model = build_model(model_config, dtype, device, progress)
    logger.info("quantization %s", apply_quantization(model, quantization, dtype))
    if model_config.moe is not None and quantization.method not in (None, "none"):
        logger.warning("quantization %s covers the attention and dense linears; the "
                       "experts' weights stay %s", quantization.method, dtype)
    if dtype == torch.bfloat16 and device.type == "cpu":
        pack_cpu_weights(model, model_config, dtype, device)
    if device.type == "cpu" and envs.KILN_HUGE_PAGES:
        move_weights_to_huge_pages(model)
    return model
