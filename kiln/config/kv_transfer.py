"""KVTransferConfig: which connector moves KV blocks in and out of the engine, in which
role, with vLLM's names.

`{"kv_connector": "disk", "kv_role": "kv_both", "kv_connector_extra_config": {"path":
DIR, "max_size": "4GiB"}}` keeps a persistent tier on disk; `"torch_distributed"` pushes a
prefill instance's blocks to a decode instance over a gloo process group (`kv_ip`,
`kv_port`: the producer's rendezvous address). Validated once here: a bad field is a
`ValueError` that names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.config.utils import config_fields, parse_bytes

ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_MAX_SIZE = "4GiB"
# How long a decode instance waits for a prompt's KV that a prefill instance is
# publishing before it computes the prompt itself.
DEFAULT_REMOTE_TIMEOUT_S = 10.0
# Each connector's name and the fields of its kv_connector_extra_config. Names are data
# here; the classes are found by name in kiln.kv_transfer.registry, whose
# `register_connector` adds a connector to this table too.
CONNECTOR_FIELDS: dict[str, set[str]] = {
    "disk": {"path", "max_size", "remote_timeout_s"},
    "torch_distributed": {"max_size", "remote_timeout_s", "connect_timeout_s"},
}


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"  # torch_distributed: the producer hosts the rendezvous here
    kv_port: int = 14579

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTOR_FIELDS:
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r} is "
                             f"unknown; use one of {', '.join(CONNECTOR_FIELDS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r} must be one of "
                             f"{', '.join(ROLES)}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict")
        unknown = sorted(set(extra) - CONNECTOR_FIELDS[self.kv_connector])
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown "
                             f"field(s) {unknown} for {self.kv_connector!r}; known: "
                             f"{sorted(CONNECTOR_FIELDS[self.kv_connector])}")
        if self.kv_connector == "disk" and not extra.get("path"):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.path is required "
                             "for the disk connector: the tier's directory")
        if self.kv_connector == "torch_distributed" and self.kv_role == "kv_both":
            raise ValueError("kv_transfer_config.kv_role='kv_both' is not a torch_distributed "
                             "role: the prefill instance is 'kv_producer', the decode "
                             "instance 'kv_consumer'")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port={self.kv_port!r} must be a port "
                             "number")
        self.max_size  # a bad size fails here, named
        for name in ("remote_timeout_s", "connect_timeout_s"):
            v = extra.get(name, 1.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name}="
                                 f"{v!r} must be a number of seconds >= 0")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def max_size(self) -> int:
        value = self.kv_connector_extra_config.get("max_size", DEFAULT_MAX_SIZE)
        return parse_bytes(value, "kv_transfer_config.kv_connector_extra_config.max_size")

    @property
    def remote_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("remote_timeout_s",
                                                        DEFAULT_REMOTE_TIMEOUT_S))

    def describe(self) -> str:
        where = self.kv_connector_extra_config.get("path") or f"{self.kv_ip}:{self.kv_port}"
        return f"{self.kv_connector} {self.kv_role} ({where})"


def parse_kv_transfer_config(value: KVTransferConfig | dict[str, Any] | str | None
                             ) -> KVTransferConfig | None:
    """A dict, a JSON string (the CLI's `--kv-transfer-config`) or a config; None: off."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    value = config_fields(value, KVTransferConfig, "kv_transfer_config",
                          '{"kv_connector": "disk", "kv_role": "kv_both", '
                          '"kv_connector_extra_config": {"path": "/tmp/kv"}}')
    if "kv_connector" not in value:
        raise ValueError("kv_transfer_config.kv_connector is required: 'disk' or "
                         "'torch_distributed'")
    return KVTransferConfig(**value)
