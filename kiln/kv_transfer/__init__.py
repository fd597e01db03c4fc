"""KV connectors: move KV blocks between the engine and a tier outside it (a directory
that survives restarts, or another engine instance for prefill/decode disaggregation).
"""
from kiln.exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "BlockStore": "base", "connector_for": "registry", "connector_names": "registry",
    "KVConnector": "base", "KVConnectorMetadata": "base", "KVConnectorRole": "base",
    "KVLayout": "layout", "KVTransferStats": "stats", "LoadSpec": "base",
    "make_connector": "registry", "make_layout": "layout", "model_fingerprint": "layout",
    "register_connector": "registry",
})
