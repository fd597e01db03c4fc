"""Read and check a PEFT LoRA adapter directory against a base model.

A directory holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`).
Tensor names look like `base_model.model.<module>.lora_A.weight`; `<module>` is the base
checkpoint's name for the projection (`model.layers.3.self_attn.q_proj`), which the
model's own `checkpoint_name` maps to a kiln layer and shard (q of the fused qkv_proj).
Every failure is a `LoRAError` (a `ValueError`) naming the adapter, the cause and the
fix, raised before anything touches the engine's slots.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.lora.layers import ModuleUpdate, shard_names
from kiln.lora.request import LoRAError, LoRARequest
from kiln.models.layers import Linear
from kiln.models.linear import ColumnParallelLinear, RowParallelLinear

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                  r"(?:\.[A-Za-z0-9_]+)?\.weight$")
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out":
                "fan_in_fan_out (Conv1D) layouts"}

# kiln module path -> {shard id: the update}
AdapterWeights = dict[str, dict[str | None, ModuleUpdate]]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int  # the largest rank of any module
    modules: AdapterWeights

    @property
    def num_bytes(self) -> int:
        return sum(u.a.nbytes + u.b.nbytes for m in self.modules.values() for u in m.values())


def load_adapter(request: LoRARequest, targets: dict[str, Linear],
                 checkpoint_name: Callable[[str], tuple[str, str | None] | None],
                 max_rank: int) -> LoRAAdapter:
    """Read `request.lora_path` and check it against `targets` (kiln.lora.layers.
    lora_targets of a model built with one rank: full checkpoint shapes)."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config = _read_config(Path(request.lora_path), where)
    tensors = _read_tensors(Path(request.lora_path), where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            others.append(key)
        else:
            pairs.setdefault(m["module"], {})[m["ab"]] = tensor.float()
    modules: AdapterWeights = {}
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {module} has lora_{''.join(ab)} but not both A and B")
        path, shard, layer = _locate(module, targets, checkpoint_name, where)
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        _check_shapes(where, module, layer, shard, a, b, max_rank)
        rank = max(rank, r)
        modules.setdefault(path, {})[shard] = ModuleUpdate(a, b, _scaling(config, module, r))
    if others:  # after the modules: a bad target is the clearer message
        raise LoRAError(f"{where}: tensor {others[0]!r} is not a LoRA A/B weight (only "
                         "lora_A/lora_B of linear projections are supported)")
    if not modules:
        raise LoRAError(f"{where}: the adapter holds no LoRA weights")
    return LoRAAdapter(request, rank, modules)


def adapter_fingerprint(path: str) -> bytes:
    """What an adapter's files hold, hashed: the KV its requests compute depends on it, so
    it keys their prefix-cache blocks (in memory and in a persistent KV tier, where an id
    from an earlier process may have named another adapter). Read once per registration."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        file = Path(path) / name
        if file.is_file():
            h.update(name.encode() + b"\0" + file.read_bytes())
    return h.digest()[:16]


def _read_config(root: Path, where: str) -> dict[str, Any]:
    file = root / "adapter_config.json"
    if not file.is_file():
        raise LoRAError(f"{where}: missing {file.name}; pass a PEFT adapter directory "
                         "(adapter_config.json + adapter_model.safetensors)")
    config = json.loads(file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type={config['peft_type']!r}; only LORA adapters "
                         "are supported")
    for field, what in _UNSUPPORTED.items():
        if config.get(field):
            raise LoRAError(f"{where}: {field}=true ({what}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r} trains bias terms, which are "
                         "not supported; use adapters trained with bias='none'")
    if config.get("modules_to_save"):
        raise LoRAError(f"{where}: modules_to_save={config['modules_to_save']} replaces "
                         "whole modules, which is not supported")
    return config


def _read_tensors(root: Path, where: str) -> dict[str, torch.Tensor]:
    st, pt = root / "adapter_model.safetensors", root / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.is_file():
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise LoRAError(f"{where}: missing adapter_model.safetensors (or adapter_model.bin)")


def _locate(module: str, targets: dict[str, Linear],
            checkpoint_name: Callable[[str], tuple[str, str | None] | None],
            where: str) -> tuple[str, str | None, Linear]:
    mapped = checkpoint_name(f"{module}.weight")
    path = mapped[0].removesuffix(".weight") if mapped else None
    if path not in targets:
        names = sorted({n.rsplit(".", 1)[-1] for n in targets})
        raise LoRAError(f"{where}: it targets {module!r}, which the base model lacks or "
                         f"cannot adapt (LoRA-able: the decoder layers' {', '.join(names)} "
                         "and their q/k/v, gate/up projections)")
    return path, mapped[1], targets[path]


def _check_shapes(where: str, module: str, layer: Linear, shard: str | None,
                  a: torch.Tensor, b: torch.Tensor, max_rank: int) -> None:
    r = a.shape[0]
    if r > max_rank:
        raise LoRAError(f"{where}: {module} has rank {r}, over max_lora_rank={max_rank}; "
                         f"start the engine with --max-lora-rank {_pow2(r)} or more")
    if shard not in shard_names(layer):
        raise LoRAError(f"{where}: {module} maps to shard {shard!r} of a layer without it")
    in_full = layer.full_in if isinstance(layer, RowParallelLinear) else layer.in_features
    out_full = layer.shards[shard].src_rows if isinstance(layer, ColumnParallelLinear) \
        else layer.out_features
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_full) \
            or tuple(b.shape) != (out_full, r):
        raise LoRAError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)}; the base model needs ({r}, {in_full}) and "
                         f"({out_full}, {r}): the adapter was trained for another model")


def _scaling(config: dict[str, Any], module: str, r: int) -> float:
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: a key applies when the module name ends with it (at a dot)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
