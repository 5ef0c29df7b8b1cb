"""The server's metrics on ``prometheus_client``: counters and histograms updated as work happens,
gauges read at scrape time, plus the short history the status page shows (throughput over the last
minutes, the last errors).

Every ``Metrics`` owns its own ``CollectorRegistry`` (two apps in one process share nothing; no
global default registry). The exposition is ``prometheus_client.generate_latest``: label values are
escaped by the library (a tenant named ``a"b`` or with a newline cannot break a scrape). Label
values are tenant names and fixed reasons, never keys or request ids. prometheus_client's metric
objects are thread-safe, so the event loop, the scheduler thread and the encoder pool update them
without a lock of ours.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

Labels = tuple[tuple[str, str], ...]
GaugeFn = Callable[[], Iterable[tuple[str, str, Labels, float]]]  # name, help, labels, value
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)  # forward-pass tokens / max_batch_tokens
WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0, 3600.0)
THROUGHPUT_BUCKET_S = 10.0  # the status page's throughput history: tokens per 10 s bucket ...
THROUGHPUT_HISTORY_S = 900.0  # ... for the last 15 minutes
RECENT_ERRORS = 20

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eagle3_requests_total": ("Extract requests admitted", ("tenant",)),
    "eagle3_tokens_extracted_total": ("Tokens whose hidden states the backend returned", ("tenant",)),
    "eagle3_samples_total": ("Samples finished, by outcome (ok, failed)", ("tenant", "outcome")),
    "eagle3_stream_bytes_total": ("DATA payload bytes streamed: kind=wire (compressed) or raw", ("tenant", "kind")),
    "eagle3_rejections_total": ("Requests refused, by reason", ("tenant", "reason")),
    "eagle3_cancellations_total": ("Requests closed before all their samples were streamed", ("tenant",)),
    "eagle3_forward_passes_total": ("backend.extract calls", ()),
    "eagle3_stage_seconds_total": (
        "Seconds spent per serving stage: forward (backend.extract), copy (states to blobs), encode (codec and "
        "framing, summed over encoder threads), send (a stream waiting for the transport to take its bytes)",
        ("stage",),
    ),
}
LANE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...], tuple[str, ...]]] = {
    "eagle3_batch_fill_ratio": ("Tokens per forward pass over max_batch_tokens", FILL_BUCKETS, ()),
    "eagle3_queue_wait_seconds": (
        "Admission to the request's first sample entering a forward pass",
        WAIT_BUCKETS_S,
        (),
    ),  # fmt: skip
    "eagle3_time_to_first_sample_seconds": (
        "Admission to the request's first sample streamed, per lane (interactive: requests of at most "
        "--interactive-max-tokens tokens; bulk: the rest)",
        LANE_BUCKETS_S,
        ("lane",),
    ),
    "eagle3_request_duration_seconds": ("Admission to the end of the request's stream", DURATION_BUCKETS_S, ()),
}


@dataclass(frozen=True)
class ErrorNote:
    """One entry of the status page's "recent errors" (no keys, no payloads)."""

    at_unix_s: float
    kind: str  # an error type or reason: tenant_quota, backend_error, payload_too_large, ...
    tenant: str
    request_id: str
    message: str


class _ScrapeGauges(Collector):
    """Gauges computed when scraped (in-flight tokens, queue depth, compression, load time, uptime)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        wire, raw = m.get("eagle3_stream_bytes_total", kind="wire"), m.get("eagle3_stream_bytes_total", kind="raw")
        gauges: list[tuple[str, str, Labels, float]] = [
            ("eagle3_compression_ratio", "Raw over wire DATA bytes so far", (), raw / wire if wire else 0.0),
            ("eagle3_load_time_seconds", "Time the backend took to load and warm up", (), m.load_time_s),
            ("eagle3_uptime_seconds", "Seconds since the server process started", (), time.monotonic() - m.started),
            *m.gauges(),
        ]
        counters: dict[str, CounterMetricFamily] = {}
        for name, text, labels, value in m.scrape_counters():
            if name not in counters:
                counters[name] = CounterMetricFamily(name, text, labels=[k for k, _ in labels])
            counters[name].add_metric([v for _, v in labels], value)
        yield from counters.values()
        families: dict[str, GaugeMetricFamily] = {}
        for name, text, labels, value in gauges:
            if name not in families:
                families[name] = GaugeMetricFamily(name, text, labels=[k for k, _ in labels])
            families[name].add_metric([v for _, v in labels], value)
        yield from families.values()


class Metrics:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.load_time_s = 0.0
        self.gauges: GaugeFn = lambda: ()
        self.scrape_counters: GaugeFn = lambda: ()  # counters kept elsewhere (the feature cache's), read when scraped
        self._lock = threading.Lock()  # the history deques only
        self.reset()

    def reset(self) -> None:
        """A fresh registry: every counter and histogram at zero (after the load's warm-up requests,
        before ready), the history emptied."""
        registry = CollectorRegistry()
        self._counters = {
            name: Counter(name, text, labelnames, registry=registry) for name, (text, labelnames) in COUNTERS.items()
        }
        self._histograms = {
            name: Histogram(name, text, labelnames, buckets=buckets, registry=registry)
            for name, (text, buckets, labelnames) in HISTOGRAMS.items()
        }
        with self._lock:
            self._throughput: deque[list[float]] = deque()  # [bucket start (monotonic), tokens]
            self.errors: deque[ErrorNote] = deque(maxlen=RECENT_ERRORS)
        registry.register(_ScrapeGauges(self))  # no describe(): registering does not collect it
        self.registry = registry

    # ---- updates ----

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        counter = self._counters[name]
        (counter.labels(**labels) if labels else counter).inc(value)
        if name == "eagle3_tokens_extracted_total":
            self._note_tokens(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        histogram = self._histograms[name]
        (histogram.labels(**labels) if labels else histogram).observe(value)

    def observe_fill(self, fill: float) -> None:
        self.observe("eagle3_batch_fill_ratio", fill)

    def note_error(self, kind: str, tenant: str, request_id: str, message: str) -> None:
        with self._lock:
            self.errors.append(ErrorNote(time.time(), kind, tenant, request_id, message[:300]))

    def _note_tokens(self, n_tokens: float) -> None:
        now = time.monotonic()
        start = now - (now - self.started) % THROUGHPUT_BUCKET_S
        with self._lock:
            if self._throughput and self._throughput[-1][0] == start:
                self._throughput[-1][1] += n_tokens
            else:
                self._throughput.append([start, n_tokens])
            while self._throughput and self._throughput[0][0] < now - THROUGHPUT_HISTORY_S:
                self._throughput.popleft()

    # ---- reads ----

    def _samples(self, name: str) -> Iterator[Sample]:
        """The samples of one counter (``..._total``) or histogram series (``..._bucket``, ``_sum``, ``_count``)."""
        base = name if name in self._counters else name.rpartition("_")[0]
        collector = self._counters.get(base) or self._histograms.get(base)
        if collector is None:
            raise KeyError(f"no counter or histogram {name!r}")
        for metric in collector.collect():
            yield from (sample for sample in metric.samples if sample.name == name)

    def get(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
        return sum(s.value for s in self._samples(name) if all(s.labels.get(k) == v for k, v in labels.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label``."""
        out: dict[str, float] = {}
        for sample in self._samples(name):
            if label in sample.labels:
                out[sample.labels[label]] = out.get(sample.labels[label], 0.0) + sample.value
        return out

    def throughput_tok_s(self, window_s: float) -> float:
        """Tokens extracted per second over the last ``window_s`` (whole 10 s buckets)."""
        now = time.monotonic()
        with self._lock:
            tokens = sum(n for start, n in self._throughput if start >= now - window_s)
        return tokens / window_s

    def throughput_history(self) -> list[tuple[float, float]]:
        """``(seconds ago, tokens/s)`` per 10 s bucket of the last 15 minutes, oldest first."""
        now = time.monotonic()
        with self._lock:
            return [(now - start, n / THROUGHPUT_BUCKET_S) for start, n in self._throughput]

    def render(self) -> str:
        """The Prometheus text exposition (``CONTENT_TYPE``)."""
        return generate_latest(self.registry).decode()

    def snapshot(self) -> dict[str, Any]:
        """Totals per tenant for the status page, read from the same registry as ``/metrics``."""
        tenants: dict[str, dict[str, float]] = {}
        for name, key in (
            ("eagle3_requests_total", "requests"),
            ("eagle3_tokens_extracted_total", "tokens"),
            ("eagle3_rejections_total", "rejections"),
        ):
            for tenant, value in self.by_label(name, "tenant").items():
                tenants.setdefault(tenant, {})[key] = value
        for sample in self._samples("eagle3_stream_bytes_total"):
            if sample.labels.get("kind") == "wire":
                row = tenants.setdefault(sample.labels["tenant"], {})
                row["bytes"] = row.get("bytes", 0.0) + sample.value
        return tenants
