"""GET /metrics of `kiln serve -dp N`: every live replica's Prometheus text, each sample
labelled `engine="<index>"` (vLLM's label for its DP engines), and the router's own series.

The text format wants each family's samples together under one HELP and one TYPE line,
so the replicas' texts are merged family by family, not concatenated: a family's header
comes from the first replica that has it, then replica 0's samples, replica 1's, ...
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.entrypoints.openai.dp_replicas import Replica

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_HEADER = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*)")


def add_label(sample: str, label: str) -> str:
    """`name{a="x"} 1` -> `name{engine="0",a="x"} 1`; `name 1` -> `name{engine="0"} 1`.
    Only the name is parsed, never the label values (which may hold '}' or spaces)."""
    m = _NAME.match(sample)
    if m is None:
        return sample
    name, rest = m.group(0), sample[m.end():]
    if rest.startswith("{}"):
        return f"{name}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


@dataclass(slots=True)
class _Family:
    headers: list[str] = field(default_factory=list)  # HELP then TYPE, once
    samples: list[str] = field(default_factory=list)


def merge_expositions(texts: Iterable[tuple[int, str]]) -> str:
    """(replica index, its /metrics text) pairs -> one exposition, families in the order
    first seen. A sample belongs to the family of the header above it (a histogram's
    _bucket/_sum/_count follow their family's TYPE line)."""
    families: dict[str, _Family] = {}
    for index, text in texts:
        label = f'engine="{index}"'
        current: str | None = None  # each text starts outside any family
        for line in text.splitlines():
            if not line.strip():
                continue
            header = _HEADER.match(line)
            if header is not None:
                kind, current = header.groups()
                fam = families.setdefault(current, _Family())
                if not any(h.startswith(f"# {kind} ") for h in fam.headers):
                    fam.headers.append(line)
            elif not line.startswith("#"):  # other comments carry nothing scraped
                name = _NAME.match(line)
                key = current or (name.group(0) if name else line)
                families.setdefault(key, _Family()).samples.append(add_label(line, label))
    out: list[str] = []
    for fam in families.values():
        out.extend(fam.headers)
        out.extend(fam.samples)
    return "\n".join(out) + "\n" if out else ""


class _RouterCollector(Collector):
    def __init__(self, replicas: list[Replica]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        labels = ["engine"]
        requests = CounterMetricFamily("kiln:dp_requests", "HTTP requests the router sent "
                                       "to this replica.", labels=labels)
        errors = CounterMetricFamily("kiln:dp_request_errors", "Requests that failed "
                                     "because this replica died or dropped them.",
                                     labels=labels)
        in_flight = GaugeMetricFamily("kiln:dp_requests_in_flight", "Requests sent to this "
                                      "replica and not yet answered in full (the routing "
                                      "signal).", labels=labels)
        up = GaugeMetricFamily("kiln:dp_replica_up", "1 while the replica serves, 0 once "
                               "it died.", labels=labels)
        for r in self._replicas:
            key = [str(r.index)]
            requests.add_metric(key, r.requests_total)
            errors.add_metric(key, r.errors_total)
            in_flight.add_metric(key, r.in_flight)
            up.add_metric(key, 1 if r.alive else 0)
        yield from (requests, errors, in_flight, up)


def router_exposition(replicas: list[Replica]) -> str:
    registry = CollectorRegistry()
    registry.register(_RouterCollector(replicas))
    return generate_latest(registry).decode()
