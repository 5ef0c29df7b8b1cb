"""Long waits are not silent: ``eagle3 extract`` against a server that is still loading says so at
once (phase, elapsed, the expected load time) and hints at ``--wait-ready-s``; with it, it reports
while it waits and then extracts."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from eagle3.client.errors import ServiceUnavailableError
from tests.unit.sdk_fake import FakeServer
from tests.unit.test_sdk_extract import make_prepared, run

LOADING = {"status": "loading", "phase": "starting vLLM 0.32.0 engine (tp=8, cuda)", "progress": 0.05,
           "elapsed_s": 840.2, "expected_s": 1320.4, "eta_s": 480.2}  # fmt: skip


class LoadingServer(FakeServer):
    """Answers as a loading eagle3 server for the first ``n_loading`` readiness/info calls."""

    def __init__(self, n_loading: int) -> None:
        super().__init__()
        self.n_loading = n_loading
        self.polls = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/readyz", "/v1/info") and self.polls < self.n_loading:
            self.polls += 1
            if request.url.path == "/readyz":
                return httpx.Response(503, json=LOADING, headers={"Retry-After": "5"})
            error = {"type": "unavailable", "message": "model is loading (starting vLLM, 5%)", "code": 503,
                     "param": None, "reason": "loading"}  # fmt: skip
            return httpx.Response(503, json={"error": error}, headers={"Retry-After": "5"})
        return super().handle(request)


def test_extract_from_a_loading_server_says_it_waits_and_how_to_wait_longer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_prepared(tmp_path / "prepared")
    server = LoadingServer(n_loading=10_000)
    with caplog.at_level(logging.INFO), pytest.raises(ServiceUnavailableError, match="--wait-ready-s") as err:
        run(tmp_path / "prepared", tmp_path / "out", "http://a", server.transport(), max_retries=2)
    assert err.value.reason == "loading"
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "eagle3.client.extract"]
    assert "not ready (loading, starting vLLM 0.32.0 engine (tp=8, cuda) (5%), loading for 840 s" in warning
    assert "of about 1320 s (the last load)" in warning and "--wait-ready-s" in warning


def test_wait_ready_reports_while_waiting_then_extracts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rows = make_prepared(tmp_path / "prepared")
    server = LoadingServer(n_loading=5)
    with caplog.at_level(logging.INFO):
        summary = run(tmp_path / "prepared", tmp_path / "out", "http://a", server.transport(), wait_ready_s=600)
    assert summary.n_samples == len(rows)
    waits = [r.getMessage() for r in caplog.records if "waiting for a server to be ready" in r.getMessage()]
    assert waits and "http://a: loading, starting vLLM" in waits[0] and "of at most 600 s" in waits[0]
