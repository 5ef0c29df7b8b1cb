"""Prometheus text exposition, hand-written: counters and a histogram here, gauges read at scrape time.

Counters are updated from the event loop and from the worker thread, so every update takes a lock.
Label values are tenant names and fixed reasons (low cardinality), never keys or request ids.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

Labels = tuple[tuple[str, str], ...]
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)  # forward-pass tokens / max_batch_tokens

HELP = {
    "eagle3_tokens_extracted_total": ("counter", "Tokens whose hidden states the backend returned"),
    "eagle3_samples_total": ("counter", "Samples finished, by outcome (ok, failed)"),
    "eagle3_requests_total": ("counter", "Extract requests admitted"),
    "eagle3_forward_passes_total": ("counter", "backend.extract calls"),
    "eagle3_stream_bytes_total": ("counter", "DATA payload bytes streamed: kind=wire (compressed) or raw"),
    "eagle3_rejections_total": ("counter", "Requests refused, by reason"),
    "eagle3_cancellations_total": ("counter", "Requests closed before all their samples were streamed"),
    "eagle3_stage_seconds_total": (
        "counter",
        "Seconds spent per serving stage: forward (backend.extract), copy (states to blobs), encode (codec and "
        "framing, summed over encoder threads), send (a stream waiting for the transport to take its bytes)",
    ),
}


def _fmt(name: str, labels: Labels, value: float) -> str:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels)
    return f"{name}{{{label_text}}} {value:g}" if labels else f"{name} {value:g}"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._fill_counts = [0] * len(FILL_BUCKETS)
        self._fill_sum = 0.0
        self._fill_n = 0
        self.load_time_s = 0.0
        self.gauges: Callable[[], Iterable[tuple[str, str, Labels, float]]] = lambda: ()  # name, help, labels, value

    def reset(self) -> None:
        """Zero every counter and the histogram (after the load's warm-up request, before ready)."""
        with self._lock:
            self._counters.clear()
            self._fill_counts = [0] * len(FILL_BUCKETS)
            self._fill_sum = 0.0
            self._fill_n = 0

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters[name].get(tuple(sorted(labels.items())), 0.0)

    def observe_fill(self, fill: float) -> None:
        with self._lock:
            self._fill_sum += fill
            self._fill_n += 1
            for i, bound in enumerate(FILL_BUCKETS):
                if fill <= bound:
                    self._fill_counts[i] += 1

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, text) in HELP.items():
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                series = self._counters.get(name) or {(): 0.0}
                lines += [_fmt(name, labels, value) for labels, value in sorted(series.items())]
            name = "eagle3_batch_fill_ratio"
            lines += [f"# HELP {name} Tokens per forward pass over max_batch_tokens", f"# TYPE {name} histogram"]
            for bound, count in zip(FILL_BUCKETS, self._fill_counts, strict=True):
                lines.append(_fmt(f"{name}_bucket", (("le", f"{bound:g}"),), count))
            lines += [
                _fmt(f"{name}_bucket", (("le", "+Inf"),), self._fill_n),
                _fmt(f"{name}_sum", (), self._fill_sum),
                _fmt(f"{name}_count", (), self._fill_n),
            ]
            wire = self._counters["eagle3_stream_bytes_total"].get((("kind", "wire"),), 0.0)
            raw = self._counters["eagle3_stream_bytes_total"].get((("kind", "raw"),), 0.0)
        gauges = [
            ("eagle3_compression_ratio", "Raw over wire DATA bytes so far", (), raw / wire if wire else 0.0),
            ("eagle3_load_time_seconds", "Time the backend took to load and warm up", (), self.load_time_s),
            *self.gauges(),
        ]
        seen: set[str] = set()
        for name, text, labels, value in gauges:
            if name not in seen:
                seen.add(name)
                lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
            lines.append(_fmt(name, labels, value))
        return "\n".join(lines) + "\n"
