"""Connectors by name (`kv_transfer_config.kv_connector`), imported on first use."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterable

from kiln.config.kv_transfer import CONNECTOR_FIELDS

if TYPE_CHECKING:
    from kiln.config.kv_transfer import KVTransferConfig
    from kiln.kv_transfer.base import KVConnector, KVConnectorRole
    from kiln.kv_transfer.layout import KVLayout

_REGISTRY: dict[str, tuple[str, str]] = {
    "disk": ("kiln.kv_transfer.disk", "DiskConnector"),
    "torch_distributed": ("kiln.kv_transfer.torch_distributed", "TorchDistributedConnector"),
}


def register_connector(name: str, module: str, class_name: str,
                       extra_fields: Iterable[str] = ()) -> None:
    """Add a connector: `module.class_name` subclasses `KVConnector`; `extra_fields` are
    the keys its `kv_connector_extra_config` may hold (the config checks them by name)."""
    if name in _REGISTRY:
        raise ValueError(f"a KV connector named {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)
    CONNECTOR_FIELDS[name] = set(extra_fields)


def connector_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_connector(config: KVTransferConfig, role: KVConnectorRole,
                   layout: KVLayout) -> KVConnector:
    module, class_name = _REGISTRY[config.kv_connector]
    return getattr(importlib.import_module(module), class_name)(config, role, layout)


def connector_for(config: KVTransferConfig, role: KVConnectorRole, fingerprint: dict,
                  kv_spec: Any, num_layers: int, quantization: Any) -> KVConnector:
    """A role's connector over this engine's cache layout (`kv_spec`: a
    FullAttentionSpec). The scheduler and the worker both build theirs here, from the
    same fields, so they agree on the namespace."""
    from kiln.kv_transfer.layout import make_layout

    layout = make_layout(fingerprint, num_layers=num_layers, block_size=kv_spec.block_size,
                         num_kv_heads=kv_spec.num_kv_heads, head_size=kv_spec.head_size,
                         dtype=kv_spec.dtype, quantization=quantization.cache_key())
    return make_connector(config, role, layout)
