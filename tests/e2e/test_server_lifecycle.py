"""Readiness and drain of a live ``eagle3 serve``: 503 loading -> 200 ready; on SIGTERM 503 draining,
new work refused, the open stream still completes with END, and the process exits 0. Past the drain
timeout open streams end with a retryable ERROR frame and the process still exits (a reader that
never reads again does not hold it up); a second signal exits at once. Bounds are loose on purpose:
drain timeout + a minute."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eagle3.core.protocol.frames import Frame, FrameDecoder, FrameType
from tests.e2e.live_server import LiveServer, iter_frames, tiny_llama_dir

pytestmark = pytest.mark.e2e


def test_loading_ready_draining_and_clean_exit(tmp_path: Path) -> None:
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    args = ["--model", str(model), "--dtype", "float32", "--max-batch-tokens", "64", "--drain-timeout-s", "300",
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
            seen = [next(frames)]
            while seen[-1].type != FrameType.DATA:  # HEADER (+ heartbeats) and a first DATA: in flight
                seen.append(next(frames))
            assert [f.type for f in seen if f.type != FrameType.HEARTBEAT] == [FrameType.HEADER, FrameType.DATA]
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
        last: Frame = seen[-1]
        assert last.type == FrameType.END and last.meta["n_samples"] == 60
        assert server.process.wait(300) == 0
    finally:
        server.stop()


def started(tmp_path: Path, *extra: str) -> LiveServer:
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    args = ["--model", str(model), "--dtype", "float32", "--max-batch-tokens", "64", "--heartbeat-s", "0.2",
            "--request-buffer-mb", "0.1", *extra]  # fmt: skip
    server = LiveServer(args, tmp_path / "server.log")
    server.wait_ready()
    return server


def open_stream(server: LiveServer, n_samples: int) -> tuple[httpx.Client, httpx.Response, list[Frame]]:
    """A big request whose reader takes HEADER and a first DATA frame, then stops reading."""
    body = {"codec": "none", "samples": [{"id": f"s{i}", "input_ids": [i % 500 + 1] * 64} for i in range(n_samples)]}
    client = httpx.Client(timeout=120)
    resp = client.send(client.build_request("POST", f"{server.url}/v1/extract", json=body), stream=True)
    assert resp.status_code == 200
    return client, resp, []


def read_until(chunks: Iterator[bytes], decoder: FrameDecoder, frames: list[Frame], n_frames: int) -> None:
    """Read from ``chunks`` (one ``iter_raw`` generator kept by the caller: a generator dropped
    half-way closes the connection, which would cancel the request instead of stalling it)."""
    for chunk in chunks:
        frames += decoder.feed(chunk)
        if len(frames) >= n_frames:
            return


def wait_for_log(server: LiveServer, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log()}"
        time.sleep(0.05)


def test_drain_timeout_aborts_open_streams_with_a_retryable_error_and_exits(tmp_path: Path) -> None:
    drain_timeout_s = 1.0
    server = started(tmp_path, "--drain-timeout-s", str(drain_timeout_s))
    try:
        reader, resp, frames = open_stream(server, 400)  # 400 x 32 KB raw: far more than the socket buffers
        stuck_client, stuck, _ = open_stream(server, 400)  # this one never reads again
        decoder = FrameDecoder()
        chunks = resp.iter_raw(4096)
        read_until(chunks, decoder, frames, 2)
        stuck_chunks = stuck.iter_raw(4096)
        next(stuck_chunks)
        server.process.send_signal(signal.SIGTERM)
        wait_for_log(server, "drain timeout: aborting 2 open stream(s)")
        for chunk in chunks:  # the rest, then the ERROR frame
            frames += decoder.feed(chunk)
        decoder.close()
        last = frames[-1]
        assert last.type == FrameType.ERROR, [f.type.name for f in frames[-3:]]
        error = last.meta["error"]
        assert (error["type"], error["reason"], error["retryable"]) == ("unavailable", "draining", True)
        sent = [f.meta["sample_id"] for f in frames if f.type == FrameType.DATA and f.meta["final"]]
        assert 0 < len(sent) < 400 and last.meta["completed_sample_ids"] == sent
        assert server.process.wait(drain_timeout_s + 60) == 0, server.log()
        assert "drain timed out" in server.log()
        reader.close()
        stuck_client.close()
    finally:
        server.stop()


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    server = started(tmp_path, "--drain-timeout-s", "600")
    try:
        client, resp, _ = open_stream(server, 400)  # keeps the drain waiting: it is never read
        chunks = resp.iter_raw(4096)
        next(chunks)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/readyz").json()["status"] != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(30) == 128 + signal.SIGINT, server.log()
        assert "second SIGINT while shutting down" in server.log()
        client.close()
    finally:
        server.stop()
