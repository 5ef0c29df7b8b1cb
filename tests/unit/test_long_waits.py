"""Long waits are not silent: ``eagle3 extract`` against a server that is still loading says so at
once (phase, elapsed, the expected load time); by default it waits at least as long as the server
expects its load to take (``eta_s``), reporting the real deadline, and its tokens/s leaves the wait
out; ``--wait-ready-s 0`` gives up early with a hint, ``--wait-ready-s N`` waits up to N s."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from eagle3.client.errors import APITimeoutError, ServiceUnavailableError
from eagle3.client.extract import ExtractConfig, ExtractSummary, extract_dataset
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
        run(tmp_path / "prepared", tmp_path / "out", "http://a", server.transport(), max_retries=2, wait_ready_s=0)
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


class ClockedLoadingServer(FakeServer):
    """A loading server on a fake clock (``now``, advanced by the client's ``sleep``): ready at ``ready_at``
    seconds; its ``/readyz`` says it expects ``LOADING["eta_s"]`` (480 s) more."""

    def __init__(self, ready_at: float) -> None:
        super().__init__()
        self.now = 0.0
        self.ready_at = ready_at

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/readyz", "/v1/info") and self.now < self.ready_at:
            self.now += 0.01  # a request takes a little time too
            if request.url.path == "/readyz":
                return httpx.Response(503, json=LOADING, headers={"Retry-After": "5"})
            error = {"type": "unavailable", "message": "loading", "code": 503, "param": None, "reason": "loading"}
            return httpx.Response(503, json={"error": error}, headers={"Retry-After": "5"})
        return super().handle(request)


def extract_clocked(tmp_path: Path, server: ClockedLoadingServer, monkeypatch: pytest.MonkeyPatch) -> ExtractSummary:
    monkeypatch.setattr("time.monotonic", lambda: server.now)
    config = ExtractConfig(progress=False)  # the defaults: no --wait-ready-s
    out = tmp_path / "out"
    return extract_dataset(
        tmp_path / "prepared", out, "http://a", config=config, transport=server.transport(), sleep=server.sleep
    )


def test_by_default_extract_waits_the_servers_own_estimate_and_leaves_the_wait_out_of_tokens_per_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = make_prepared(tmp_path / "prepared")
    server = ClockedLoadingServer(ready_at=470.0)  # within its estimate of 480 s more
    with caplog.at_level(logging.INFO):
        summary = extract_clocked(tmp_path, server, monkeypatch)
    assert summary.n_samples == len(rows)
    waits = [r.getMessage() for r in caplog.records if "waiting for a server to be ready" in r.getMessage()]
    assert waits and "of at most 720 s" in waits[0], "the deadline said must be the real one (480 s x 1.5)"
    assert "loading for 840 s of about 1320 s" in waits[0]
    assert summary.wait_s >= 470 and summary.wall_s < 5
    assert "after 470 s waiting for the server to load" in summary.format_text()


def test_by_default_extract_gives_up_only_past_the_servers_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_prepared(tmp_path / "prepared")
    server = ClockedLoadingServer(ready_at=10_000.0)
    with pytest.raises(APITimeoutError, match="no server ready after 720 s"):
        extract_clocked(tmp_path, server, monkeypatch)
    assert 720 <= server.now < 730
