"""Random PEFT adapters for the LoRA tests, and transformers + peft as the reference."""
from __future__ import annotations

import copy
from pathlib import Path

import peft
import torch
import transformers

from conftest import hf_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: transformers.PreTrainedModel, path: Path, r: int,
                 targets: list[str], seed: int, b_scale: float = 1.0,
                 safetensors: bool = True, **config) -> peft.PeftModel:
    """Save a random adapter at `path`; return the base model with it loaded (by peft,
    from the saved files: what the reference runs is what kiln reads). B is random too
    (init_lora_weights=False), so the adapter really changes the outputs."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                          init_lora_weights=False, **config)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(b_scale)
    model.save_pretrained(path, safe_serialization=safetensors)
    return peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()


def peft_greedy(model: peft.PeftModel, prompts: list[list[int]], max_new: int
                ) -> list[list[int]]:
    return [hf_greedy(model, p, max_new) for p in prompts]
