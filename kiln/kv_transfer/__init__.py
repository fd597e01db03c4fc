"""KV connectors: move KV blocks between the engine and a tier outside it (a directory
that survives restarts, or another engine instance for prefill/decode disaggregation)."""
from kiln.kv_transfer.base import (BlockStore, KVConnector, KVConnectorMetadata,
                                   KVConnectorRole, LoadSpec)
from kiln.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from kiln.kv_transfer.layout import KVLayout, make_layout, model_fingerprint
from kiln.kv_transfer.registry import (connector_for, connector_names, make_connector,
                                       register_connector)
from kiln.kv_transfer.stats import KVTransferStats

__all__ = ["BlockStore", "KVConnector", "KVConnectorMetadata", "KVConnectorRole",
           "KVLayout", "KVTransferConfig", "KVTransferStats", "LoadSpec", "connector_for",
           "connector_names",
           "make_connector", "make_layout", "model_fingerprint", "parse_kv_transfer_config",
           "register_connector"]
