"""Platform: what a device is and can do. One place answers it, so the config, the
kernels, the tuning table, the compile cache and the runner agree.

A platform is a device type (`cpu`, `cuda`, or a plugin's); `kiln.platforms.platform_for`
gives the one for an engine's device, `kiln.platforms.current_platform` the one this
process uses by default (a `kiln.platform_plugins` entry may supply it: see
docs/plugins.md). The surface follows vLLM's `Platform` where it applies to kiln.
"""
from __future__ import annotations

import os
from typing import Any, ClassVar

import torch


class Platform:
    device_type: ClassVar[str]
    # torch.distributed's backend between this device's ranks (the CPU group is gloo).
    dist_backend: ClassVar[str] = "gloo"
    # The `quantization` methods this device runs (kiln.config.quantization's names).
    supported_quantization: ClassVar[tuple[str, ...]] = ("int8", "int8-channel", "gguf")
    # The variable that limits which devices a process sees ("" when none does).
    device_control_env_var: ClassVar[str] = ""
    supports_cuda_graphs: ClassVar[bool] = False
    # Eager runs before each capture: CUDA needs one (lazy init, cuBLAS workspaces, Triton
    # autotuning must not happen inside a capture); the CPU test graph needs none.
    graph_warmups: ClassVar[int] = 0
    # Attention backends to try when none is named, best first (kiln.attention.selector).
    attention_backends: ClassVar[tuple[str, ...]] = ("torch",)
    # Physical device ids assigned to this process by a launcher (13.4); None: not set.
    _assigned_physical_ids: ClassVar[list[int] | None] = None

    def device_name(self, device: str | torch.device | None = None) -> str:
        """A stable name for the device: the key of the kernel tuning table and of the
        compile cache (a table or an artifact from another device never applies)."""
        raise NotImplementedError

    def fast_bf16(self) -> bool:
        """Whether bfloat16 runs faster than float32 here (dtype='auto' then downcasts
        float32 checkpoints, as vLLM does)."""
        return False

    def get_attn_backend_cls(self, selected: str | None = None) -> tuple[str, ...]:
        """The attention backends to try, by kiln name, best first: the one `selected`
        (the user's `attention_backend`) alone, else this platform's preference list."""
        return (selected,) if selected is not None else self.attention_backends

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        """Adjust an `EngineConfig` in place, early at start-up (before the model is
        resolved): a plugin's platform sets its defaults or refuses what it cannot run
        with a ValueError. The built-in platforms need nothing."""

    # ---- device-id namespaces (vLLM's 13.4) ---------------------------------------------
    # logical: the rank's local index; visible: torch's index after the control variable's
    # remapping; physical: the machine's id, whatever the variable says.
    @classmethod
    def set_assigned_physical_device_ids(cls, ids: list[int]) -> None:
        """Record the physical ids a launcher gave this process; idempotent, and a second,
        different assignment is a RuntimeError (two launchers disagree)."""
        ids = list(ids)
        if cls._assigned_physical_ids is not None and cls._assigned_physical_ids != ids:
            raise RuntimeError(f"physical device ids already assigned as "
                               f"{cls._assigned_physical_ids}, not {ids}")
        cls._assigned_physical_ids = ids

    def visible_device_ids(self) -> list[int] | None:
        """The physical ids the control variable exposes, in order; None when unset (an
        empty value counts as unset, as a CPU-only Ray bundle leaves it) or when it names
        devices by UUID or MIG name rather than index."""
        value = os.environ.get(self.device_control_env_var, "") \
            if self.device_control_env_var else ""
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not all(v.isdigit() for v in items):
            return None  # UUIDs or MIG names: opaque, so the logical index is used as is
        return [int(v) for v in items] or None

    def device_id_to_physical_device_id(self, logical: int) -> int:
        assigned = type(self)._assigned_physical_ids
        if assigned is not None:
            return assigned[logical]
        visible = self.visible_device_ids()
        return visible[logical] if visible is not None else logical

    def logical_device_id_to_visible_device_id(self, logical: int) -> int:
        """The torch index of logical device `logical`; a physical device this process
        cannot see is a RuntimeError rather than a silently different device."""
        physical = self.device_id_to_physical_device_id(logical)
        visible = self.visible_device_ids()
        if visible is None:
            return physical
        if physical not in visible:
            raise RuntimeError(f"physical device {physical} is not visible to this process "
                               f"({self.device_control_env_var}={visible})")
        return visible.index(physical)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
