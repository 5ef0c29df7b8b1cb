"""Counters for ``eagle3 prepare``: kept/dropped with reasons, token totals, length histogram.

Memory is bounded by the longest allowed sample, not by the dataset: lengths are kept as a
``length -> count`` table (at most ``max_length`` entries), which gives exact percentiles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_EXAMPLES = 20  # malformed-row examples kept for stats.json


@dataclass
class PrepareStats:
    rows_read: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    total_tokens: int = 0
    assistant_tokens: int = 0
    length_counts: Counter[int] = field(default_factory=Counter)
    malformed_examples: list[str] = field(default_factory=list)

    def keep(self, n_tokens: int, n_assistant: int) -> None:
        self.kept += 1
        self.total_tokens += n_tokens
        self.assistant_tokens += n_assistant
        self.length_counts[n_tokens] += 1

    def drop(self, reason: str, example: str | None = None) -> None:
        self.dropped[reason] += 1
        if example is not None and len(self.malformed_examples) < MAX_EXAMPLES:
            self.malformed_examples.append(example)

    def percentile(self, q: float) -> int:
        """Smallest length L such that at least ``q`` of kept samples are <= L (0 when empty)."""
        if not self.kept:
            return 0
        need, seen = q * self.kept, 0
        for length in sorted(self.length_counts):
            seen += self.length_counts[length]
            if seen >= need:
                return length
        return max(self.length_counts)

    def histogram(self) -> list[tuple[int, int, int]]:
        """Power-of-two buckets ``(low, high, count)``: ``low <= length < high``."""
        buckets: Counter[int] = Counter()
        for length, count in self.length_counts.items():
            buckets[max(length, 1).bit_length()] += count
        return [(1 << (b - 1), 1 << b, buckets[b]) for b in sorted(buckets)]

    def to_dict(self) -> dict[str, Any]:
        lengths = sorted(self.length_counts)
        return {
            "rows_read": self.rows_read,
            "samples_kept": self.kept,
            "samples_truncated": self.truncated,
            "samples_dropped": sum(self.dropped.values()),
            "dropped_by_reason": dict(sorted(self.dropped.items())),
            "total_tokens": self.total_tokens,
            "assistant_tokens": self.assistant_tokens,
            "length": {
                "min": lengths[0] if lengths else 0,
                "p50": self.percentile(0.5),
                "p90": self.percentile(0.9),
                "p99": self.percentile(0.99),
                "max": lengths[-1] if lengths else 0,
                "mean": round(self.total_tokens / self.kept, 2) if self.kept else 0.0,
            },
            "length_histogram": [{"low": lo, "high": hi, "count": n} for lo, hi, n in self.histogram()],
            "malformed_examples": self.malformed_examples,
        }

    def format_text(self) -> str:
        d = self.to_dict()
        share = 100.0 * self.assistant_tokens / self.total_tokens if self.total_tokens else 0.0
        reasons = ", ".join(f"{k} {v}" for k, v in d["dropped_by_reason"].items()) or "-"
        ln = d["length"]
        lines = [
            f"  rows read   {self.rows_read:>10,}",
            f"  kept        {self.kept:>10,} samples (truncated {self.truncated:,})",
            f"  dropped     {d['samples_dropped']:>10,} ({reasons})",
            f"  tokens      {self.total_tokens:>10,} total, {self.assistant_tokens:,} assistant ({share:.1f}%)",
            f"  length      min {ln['min']}  p50 {ln['p50']}  p90 {ln['p90']}  p99 {ln['p99']}  "
            f"max {ln['max']}  mean {ln['mean']}",
            "  length histogram (tokens: samples)",
        ]
        top = max((n for _, _, n in self.histogram()), default=1)
        for lo, hi, n in self.histogram():
            bar = "#" * max(1, round(40 * n / top))
            lines.append(f"    [{lo:>6}, {hi:>6})  {n:>8,}  {bar}")
        return "\n".join(lines)
