"""Engine side: check each adapter once, before any request that names it is scheduled.

A bad adapter (missing file, rank over the limit, a module the model lacks, shapes of
another model) fails its own request with a `LoRAError` (a `ValueError`), and the workers
never see it.
The check runs against the model's structure built on the `meta` device (no memory),
so it needs no worker and sees the checkpoint's full shapes.
"""
from __future__ import annotations

from collections import Counter

import torch

from kiln.config.lora import LoRAConfig
from kiln.lora.adapter import adapter_fingerprint, load_adapter
from kiln.lora.layers import lora_targets
from kiln.lora.request import LoRAError, LoRARequest
from kiln.models.model_config import ModelConfig
from kiln.models.registry import model_class


class AdapterRegistry:
    def __init__(self, model_config: ModelConfig, cfg: LoRAConfig) -> None:
        with torch.device("meta"):
            model = model_class(model_config.architecture)(model_config)
        self.cfg = cfg
        self._targets = lora_targets(model)
        self._checkpoint_name = model.checkpoint_name
        self.known: dict[int, LoRARequest] = {}
        # Unloaded ids keep their meaning: KV cached under an id must never be served to
        # another adapter that reuses it.
        self.retired: dict[int, LoRARequest] = {}
        self.request_counts: Counter[str] = Counter()  # requests per adapter name
        # lora_int_id -> the adapter's fingerprint: its requests' first-block hash key.
        self.keys: dict[int, bytes] = {}

    def check(self, request: LoRARequest) -> None:
        """Raise LoRAError unless `request` names a usable adapter; checked once per id
        (again after an unload: the files may have changed)."""
        lid = request.lora_int_id
        known = self.known.get(lid) or self.retired.get(lid)
        if known is not None and known != request:
            raise LoRAError(f"lora_int_id {lid} already names adapter {known.lora_name!r} "
                            f"at {known.lora_path}; give {request.lora_name!r} its own id")
        if lid in self.known:
            return
        load_adapter(request, self._targets, self._checkpoint_name, self.cfg.max_lora_rank)
        self.keys[lid] = adapter_fingerprint(request.lora_path)
        self.retired.pop(lid, None)
        self.known[lid] = request

    def forget(self, lora_int_id: int) -> LoRARequest | None:
        request = self.known.pop(lora_int_id, None)
        if request is not None:
            self.retired[lora_int_id] = request
        return request
