"""Connectors by name (`kv_transfer_config.kv_connector`), imported on first use."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.kv_transfer.base import KVConnector, KVConnectorRole
    from kiln.kv_transfer.config import KVTransferConfig
    from kiln.kv_transfer.layout import KVLayout

_REGISTRY: dict[str, tuple[str, str]] = {
    "disk": ("kiln.kv_transfer.disk", "DiskConnector"),
    "torch_distributed": ("kiln.kv_transfer.torch_distributed", "TorchDistributedConnector"),
}


def register_connector(name: str, module: str, class_name: str) -> None:
    """Add a connector: `module.class_name` subclasses `KVConnector`."""
    if name in _REGISTRY:
        raise ValueError(f"a KV connector named {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def connector_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_connector(config: KVTransferConfig, role: KVConnectorRole,
                   layout: KVLayout) -> KVConnector:
    module, class_name = _REGISTRY[config.kv_connector]
    return getattr(importlib.import_module(module), class_name)(config, role, layout)
