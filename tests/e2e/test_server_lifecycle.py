"""Readiness and drain of a live ``eagle3 serve``: 503 loading -> 200 ready; on SIGTERM 503 draining,
new work refused, the open stream still completes with END, and the process exits 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from client.protocol.frames import FrameType
from tests.e2e.live_server import LiveServer, iter_frames, tiny_llama_dir

pytestmark = pytest.mark.e2e


def test_loading_ready_draining_and_clean_exit(tmp_path: Path) -> None:
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    args = ["--model", str(model), "--dtype", "float32", "--max-batch-tokens", "64", "--drain-timeout-s", "60",
            "--heartbeat-s", "0.2"]  # fmt: skip
    server = LiveServer(args, tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while "eagle3 serve: listening on http://127.0.0.1:" not in server.log():
            assert server.process.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.02)
        loading = httpx.get(f"{server.url}/readyz")
        assert loading.status_code == 503, "the model cannot be loaded yet: the port binds first"
        body = loading.json()
        assert body["status"] == "loading" and 0.0 <= body["progress"] <= 1.0 and body["elapsed_s"] >= 0
        assert isinstance(body["phase"], str) and body["phase"]
        assert httpx.get(f"{server.url}/livez").status_code == 200
        early = httpx.post(f"{server.url}/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]})
        assert early.status_code in (503, 200)  # it may just have become ready
        if early.status_code == 503:
            assert early.json()["error"]["reason"] == "loading" and early.headers["retry-after"]
        server.wait_ready()

        body_json = {"samples": [{"id": f"s{i}", "input_ids": [i + 1] * 64} for i in range(60)]}
        with httpx.stream("POST", f"{server.url}/v1/extract", json=body_json, timeout=60) as resp:
            frames = iter_frames(resp)
            seen = [next(frames), next(frames)]  # HEADER and a first DATA: the stream is in flight
            assert [f.type for f in seen] == [FrameType.HEADER, FrameType.DATA]
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (ready := httpx.get(f"{server.url}/readyz")).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            refused = httpx.post(f"{server.url}/v1/extract", json={"samples": [{"id": "b", "input_ids": [1]}]})
            assert refused.status_code == 503
            assert refused.json()["error"]["reason"] == "draining" and refused.headers["retry-after"]
            seen += list(frames)
        assert seen[-1].type == FrameType.END and seen[-1].meta["n_samples"] == 60
        assert server.process.wait(60) == 0
    finally:
        server.stop()
