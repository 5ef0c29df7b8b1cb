from __future__ import annotations

from eagle3.client.prepare_stats import PrepareStats


def test_percentiles_histogram_and_totals():
    stats = PrepareStats()
    for n in [10, 20, 30, 40, 100]:
        stats.keep(n, n // 2)
    stats.drop("too_long")
    stats.drop("malformed", "f:3: bad")
    d = stats.to_dict()
    assert d["samples_kept"] == 5 and d["samples_dropped"] == 2
    assert d["dropped_by_reason"] == {"malformed": 1, "too_long": 1}
    assert d["total_tokens"] == 200 and d["assistant_tokens"] == 100
    assert d["length"] == {"min": 10, "p50": 30, "p90": 100, "p99": 100, "max": 100, "mean": 40.0}
    assert d["length_histogram"] == [
        {"low": 8, "high": 16, "count": 1},
        {"low": 16, "high": 32, "count": 2},
        {"low": 32, "high": 64, "count": 1},
        {"low": 64, "high": 128, "count": 1},
    ]
    assert d["malformed_examples"] == ["f:3: bad"]
    text = stats.format_text()
    assert "too_long 1" in text and "[    16,     32)" in text


def test_empty_stats():
    d = PrepareStats().to_dict()
    assert d["length"]["p50"] == 0 and d["length_histogram"] == []
