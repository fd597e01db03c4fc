"""Worker side: adapters in device slots (LRU) with a CPU cache (LRU) behind them.

The scheduler guarantees a step never needs more distinct adapters than there are slots,
so `activate` can always place every adapter of the step: it keeps those already in a
slot, and loads the rest into free slots or over the least recently used adapters that
this step does not need. Writing a slot copies into the existing buffers (never new
tensors), so the compiled graph does not change.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from kiln.config.lora import LoRAConfig
from kiln.lora.adapter import LoRAAdapter, load_adapter
from kiln.lora.layers import clear_slot, install_slots, write_slot
from kiln.lora.request import LoRAError, LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, cfg: LoRAConfig, indices: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.targets = install_slots(model, cfg, indices, dtype)
        self._checkpoint_name = model.checkpoint_name
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.num_loads = 0  # adapters read from disk
        self.num_slot_writes = 0  # adapters copied into a slot
        self.failed: dict[int, str] = {}  # this step's adapters that failed to load
        logger.info("LoRA: %d slots of rank %d on %d linears, CPU cache of %d adapters",
                    cfg.max_loras, cfg.max_lora_rank, len(self.targets), cfg.cpu_capacity)

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Make every adapter in `requests` resident; return {lora_int_id: slot}. An
        adapter that no longer loads (the engine checked its files when it was added;
        they may have gone since) gets slot -1 and its message in `failed`: its rows
        run on the base model and the engine fails its requests alone."""
        wanted: dict[int, LoRARequest] = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.cfg.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters but there are "
                               f"{self.cfg.max_loras} slots (the scheduler must prevent it)")
        for lid in wanted:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
        self.failed = {}
        for lid, request in wanted.items():
            if lid not in self.slot_of:
                try:
                    adapter = self._adapter(request)
                except LoRAError as exc:  # its files changed or vanished since the check
                    self.failed[lid] = str(exc)
                    continue
                self._place(adapter, set(wanted))
        return {lid: self.slot_of.get(lid, -1) for lid in wanted}

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unload): its slot is cleared, its CPU copy dropped."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.targets.values():
                clear_slot(layer, slot)
        return self.cpu_cache.pop(lora_int_id, None) is not None or slot is not None

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        lid = request.lora_int_id
        if lid in self.cpu_cache:
            self.cpu_cache.move_to_end(lid)
            return self.cpu_cache[lid]
        adapter = load_adapter(request, self.targets, self._checkpoint_name,
                               self.cfg.max_lora_rank)
        self.num_loads += 1
        while len(self.cpu_cache) >= self.cfg.cpu_capacity:
            evicted, _ = self.cpu_cache.popitem(last=False)
            logger.debug("LoRA CPU cache: evicted adapter %d", evicted)
        self.cpu_cache[lid] = adapter
        return adapter

    def _place(self, adapter: LoRAAdapter, keep: set[int]) -> None:
        used = set(self.slot_of.values())
        free = [s for s in range(self.cfg.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(lid for lid in self.slot_of if lid not in keep)
            slot = self.slot_of.pop(victim)
            logger.debug("LoRA slot %d: adapter %d evicted", slot, victim)
        for path, layer in self.targets.items():
            updates = adapter.modules.get(path)
            if updates is None:
                clear_slot(layer, slot)
            else:
                write_slot(layer, slot, updates, self.cfg.max_lora_rank)
        self.slot_of[adapter.request.lora_int_id] = slot
        self.num_slot_writes += 1
