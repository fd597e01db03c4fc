"""GET /metrics: Prometheus text format, with vLLM's metric names under `kiln:`.

Per-request numbers (finishes, tokens, TTFT, inter-token latency, end-to-end latency) are
pushed by the engine thread through the `StatsObserver` methods. Scheduler numbers
(running, waiting, KV usage, prefix-cache counters, preemptions, and with speculative
decoding `kiln:spec_decode_*`: drafts, draft and accepted tokens, accepted per position,
acceptance rate, mean accepted length; with a KV connector `kiln:kv_transfer_*`: blocks
and bytes loaded and saved, load time, failures, hit rate) are read at scrape time
from the snapshot the engine thread publishes after each step, so scraping never touches
the engine itself; requests per LoRA adapter (`kiln:lora_requests_total{lora_name}`) come
from a copy of the engine's counts published the same way.

`kiln:kv_cache_usage_perc` counts blocks held by requests. Blocks kept only for prefix
caching (reference count 0, evictable) are free, so once every request has finished the
value is 0; anything else is a leak.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.kv_transfer.stats import KVTransferStats
from kiln.scheduler.step import SchedulerStats
from kiln.spec_decode.metrics import SpecDecodingStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _SchedulerCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("kiln:num_requests_running", "Requests in the running batch.",
                                value=s.num_running)
        yield GaugeMetricFamily("kiln:num_requests_waiting", "Requests waiting to run.",
                                value=s.num_waiting)
        yield GaugeMetricFamily("kiln:kv_cache_usage_perc",
                                "Fraction of KV blocks held by requests (0..1); "
                                "prefix-cached free blocks count as free.",
                                value=s.kv_cache_usage)
        yield CounterMetricFamily("kiln:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("kiln:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.",
                                  value=s.prefix_cache_hits)
        yield GaugeMetricFamily("kiln:prefix_cache_hit_rate",
                                "prefix_cache_hits / prefix_cache_queries since start.",
                                value=s.prefix_cache_hit_rate)
        yield CounterMetricFamily("kiln:num_preemptions", "Preemptions since start.",
                                  value=s.num_preemptions)
        if s.spec_decoding is not None:
            yield from _spec_metrics(s.spec_decoding)
        if s.kv_transfer is not None:
            yield from _kv_transfer_metrics(s.kv_transfer)


_KV_COUNTERS = (
    ("blocks_loaded", "KV blocks loaded from the connector."),
    ("bytes_loaded", "Bytes of KV loaded from the connector."),
    ("load_time_s", "Seconds spent reading and verifying loaded blocks."),
    ("load_failures", "Corrupt or truncated blocks found (recomputed instead)."),
    ("blocks_saved", "KV blocks saved (or sent) through the connector."),
    ("bytes_saved", "Bytes of KV saved (or sent)."),
    ("save_failures", "Blocks that could not be saved or sent."),
    ("blocks_evicted", "Blocks evicted by the tier's size budget."),
    ("hit_tokens", "Prompt tokens supplied by the connector."),
    ("query_tokens", "Prompt tokens looked up in the connector (past local hits)."),
    ("remote_timeouts", "Requests whose remote prefill did not arrive in time."),
)


def _kv_transfer_metrics(kt: KVTransferStats) -> Iterator[Metric]:
    for name, help_text in _KV_COUNTERS:
        yield CounterMetricFamily(f"kiln:kv_transfer_{name}", help_text,
                                  value=getattr(kt, name))
    yield GaugeMetricFamily("kiln:kv_transfer_hit_rate", "hit_tokens / query_tokens since "
                            "start.", value=kt.hit_rate)


def _spec_metrics(sd: SpecDecodingStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, plus the derived rates."""
    yield CounterMetricFamily("kiln:spec_decode_num_drafts", "Request-steps that verified "
                              "draft tokens.", value=sd.num_drafts)
    yield CounterMetricFamily("kiln:spec_decode_num_draft_tokens", "Draft tokens verified.",
                              value=sd.num_draft_tokens)
    yield CounterMetricFamily("kiln:spec_decode_num_accepted_tokens", "Draft tokens "
                              "accepted.", value=sd.num_accepted_tokens)
    per_pos = CounterMetricFamily("kiln:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at this position was accepted.",
                                  labels=["position"])
    for i, n in enumerate(sd.accepted_per_pos):
        per_pos.add_metric([str(i)], n)
    yield per_pos
    yield GaugeMetricFamily("kiln:spec_decode_acceptance_rate", "Accepted / drafted tokens "
                            "since start.", value=sd.acceptance_rate)
    yield GaugeMetricFamily("kiln:spec_decode_mean_accepted_length", "Tokens emitted per "
                            "verification, the bonus token included.",
                            value=sd.mean_accepted_length)


class _LoRACollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kiln:lora_requests", "Engine requests (one per "
                                     "prompt) per LoRA adapter since start.",
                                     labels=["lora_name"])
        for name, count in sorted(self._counts().items()):
            family.add_metric([name], count)
        yield family


class ServerMetrics:
    """The server's registry; also the engine's `StatsObserver` (prometheus_client
    metrics are thread-safe, so the engine thread may record directly). `lora_counts`:
    requests per adapter name, for a server with LoRA."""

    def __init__(self, stats: Callable[[], SchedulerStats],
                 lora_counts: Callable[[], dict[str, int]] | None = None) -> None:
        disable_created_metrics()  # process-wide; the *_created series only add noise
        self.registry = r = CollectorRegistry()
        self.finished = Counter("kiln:request_success", "Finished requests (per choice) by "
                                "finish reason.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens of requests that "
                                     "produced a first token.", registry=r)
        self.generation_tokens = Counter("kiln:generation_tokens", "Generated tokens.",
                                         registry=r)
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between two outputs "
                             "of one request.", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_SchedulerCollector(stats))
        if lora_counts is not None:
            r.register(_LoRACollector(lora_counts))

    # StatsObserver
    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_new_tokens: int, inter_token_s: float | None) -> None:
        self.generation_tokens.inc(num_new_tokens)
        if inter_token_s is not None:
            self.itl.observe(inter_token_s)

    def record_finished(self, finish_reason: str, e2e_s: float) -> None:
        self.finished.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
