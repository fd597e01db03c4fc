"""Host-level helpers every multi-process part shares, without torch: a free TCP port
and Ray, the optional extra (imported only where a `ray` backend is asked for)."""
from __future__ import annotations

import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the caller binds it soon: another process may take it
    meanwhile, which then fails that start loudly)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def import_ray(setting: str, fallback: str) -> Any:
    """The `ray` module, or a ValueError naming the `setting` that asked for it and the
    `fallback` that needs no Ray."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{setting} needs Ray: pip install 'kiln-llm[ray]' (or ray), or "
                         f"use {fallback}") from None
    return ray
