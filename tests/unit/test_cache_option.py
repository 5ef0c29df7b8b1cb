"""The request's ``cache`` field end to end in process: the SDK sends it, the route honours it (a repeat
skips the backend, ``bypass`` reaches it), an unknown value is a 400 naming the field, and ``/v1/info``
and ``/metrics`` say what the cache did."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eagle3.client.sdk import ExtractionClient
from eagle3.server.app import create_app
from tests.unit.test_server_app import FakeBackend, settings, wait_for


def test_repeats_skip_the_backend_and_bypass_reaches_it(tmp_path: Path) -> None:
    backend = FakeBackend(tmp_path)
    with TestClient(create_app(settings(), backend)) as http:
        wait_for(http, "ready")
        samples = [{"id": "a", "input_ids": [5, 6, 7]}, {"id": "b", "input_ids": [8, 9]}]
        with ExtractionClient("http://testserver", http_client=http) as client:  # type: ignore[arg-type]
            assert client.info().cache_on and client.info().interactive_max_tokens == 2048
            n_calls = len(backend.calls)
            first = {s.sample_id: s.hidden_states_bf16.tobytes() for s in client.extract(samples)}
            assert len(backend.calls) == n_calls + 1
            again = {s.sample_id: s.hidden_states_bf16.tobytes() for s in client.extract(samples)}
            assert len(backend.calls) == n_calls + 1 and again == first
        with ExtractionClient("http://testserver", http_client=http, cache="bypass") as bypass:  # type: ignore[arg-type]
            fresh = {s.sample_id: s.hidden_states_bf16.tobytes() for s in bypass.extract(samples)}
            assert len(backend.calls) == n_calls + 2 and fresh == first
        metrics = http.get("/metrics").text
        assert 'eagle3_cache_hits_total{tier="memory"} 2.0' in metrics
        assert "eagle3_cache_misses_total 2.0" in metrics
        resp = http.post("/v1/extract", json={"samples": samples, "cache": "sometimes"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache"


def test_a_server_without_a_cache_says_so_and_accepts_both_modes(tmp_path: Path) -> None:
    backend = FakeBackend(tmp_path)
    with TestClient(create_app(settings(cache_memory_bytes=0), backend)) as http:
        wait_for(http, "ready")
        info = http.get("/v1/info").json()
        assert info["feature_cache"] == {} and "eagle3_cache" not in http.get("/metrics").text
        n_calls = len(backend.calls)
        for mode in ("use", "bypass", "use"):
            body = {"samples": [{"id": "a", "input_ids": [1, 2]}], "cache": mode}
            assert http.post("/v1/extract", json=body).status_code == 200
        assert [lengths for _, lengths in backend.calls[n_calls:]] == [[2], [2], [2]]


def test_the_sdk_refuses_an_unknown_cache_mode() -> None:
    with pytest.raises(ValueError, match="cache must be one of use, bypass"):
        ExtractionClient("http://x", cache="never")
