"""What a connection may cost before validation (server/request_limits.py), against the real app under
uvicorn in this process (fake backend, 127.0.0.1, raw sockets where a client misbehaves): a body that
never finishes is a 408 after ``--body-timeout-s``; a tenant's open requests are capped (429
``tenant_connections``) and come back when the client goes; a client vanishing mid-upload costs one
info line, no traceback; a query string never reaches the access log; the Content-Type must be JSON;
API keys come from ``$EAGLE3_API_KEYS_FILE`` / ``$EAGLE3_API_KEYS`` (not ``ps``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from eagle3.cli import build_parser
from eagle3.server.app import create_app
from eagle3.server.cli import settings_from_args
from tests.e2e.live_server import free_port
from tests.unit.test_server_app import FakeBackend, settings

KEY = "k-secret-1"


class Served:
    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("app not ready")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def partial_upload(self, declared: int = 1000, sent: bytes = b'{"samples": [') -> socket.socket:
        """A connection that sent its headers and part of its body, and then nothing."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        head = (f"POST /v1/extract HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + sent)
        return sock


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    conf = settings(api_keys={KEY: "t1"}, body_timeout_s=1.0, max_tenant_connections=2)
    with Served(create_app(conf, FakeBackend(tmp_path_factory.mktemp("m")))) as s:
        yield s


def post(served: Served, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.post(served.url + "/v1/extract", headers=headers, timeout=30, **kwargs)


OK_BODY = {"samples": [{"id": "a", "input_ids": [1, 2, 3]}]}


def test_a_body_that_never_finishes_is_a_408(served: Served) -> None:
    sock = served.partial_upload()
    started = time.monotonic()
    answer = sock.recv(65536).decode("latin-1")
    sock.close()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"type":"request_timeout"' in answer and "x-should-retry: true" in answer.lower()
    assert time.monotonic() - started < 10


def test_a_tenant_holds_at_most_its_connection_cap(served: Served) -> None:
    held = [served.partial_upload(), served.partial_upload()]
    time.sleep(0.2)  # both are reading their bodies
    resp = post(served, json=OK_BODY)
    assert resp.status_code == 429 and resp.json()["error"]["reason"] == "tenant_connections", resp.text
    assert resp.headers["x-should-retry"] == "true"
    for sock in held:
        sock.close()  # the client went away: its slots come back
    deadline = time.monotonic() + 10
    while (resp := post(served, json=OK_BODY)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resp.status_code == 200, resp.text


def test_a_client_gone_mid_upload_is_one_info_line(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    socks = [served.partial_upload() for _ in range(2)]
    time.sleep(0.3)  # the app is reading their bodies
    for sock in socks:
        sock.close()
    socks = [served.partial_upload() for _ in range(2)]
    time.sleep(0.3)
    for sock in socks:
        sock.close()
    sock = served.partial_upload()
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 10
    gone: list[logging.LogRecord] = []
    while len(gone) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
        gone = [r for r in caplog.records if "disconnected during upload" in r.getMessage()]
    assert len(gone) == 5 and all(r.levelno == logging.INFO for r in gone)
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert post(served, json=OK_BODY).status_code == 200


def test_query_strings_are_not_logged(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    httpx.get(served.url + "/v1/info?api_key=SUPERSECRET&x=1", timeout=10)
    time.sleep(0.2)
    access = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any("/v1/info?[redacted]" in line for line in access), access
    server_side = [r.getMessage() for r in caplog.records if r.name != "httpx"]  # httpx logs the client's URL
    assert not [line for line in server_side if "SUPERSECRET" in line]


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_the_body_must_be_declared_json(served: Served, ctype: str | None) -> None:
    import json

    headers = {"Content-Type": ctype} if ctype else {}
    resp = post(served, content=json.dumps(OK_BODY).encode(), headers=headers)
    assert resp.status_code == 415 and resp.json()["error"]["type"] == "unsupported_media_type", resp.text
    assert resp.headers["x-should-retry"] == "false"
    ok = post(served, content=json.dumps(OK_BODY).encode(), headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_api_keys_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("alice: key-from-file\n")
    monkeypatch.setenv("EAGLE3_API_KEYS_FILE", str(keys_file))
    monkeypatch.setenv("EAGLE3_API_KEYS", '{"bob": "key-from-env"}')
    args = build_parser().parse_args(["serve", "--backend", "hf", "--model", "SmolLM2-135M-Instruct"])
    assert settings_from_args(args).api_keys == {"key-from-file": "alice", "key-from-env": "bob"}
    monkeypatch.setenv("EAGLE3_API_KEYS_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing"):
        settings_from_args(build_parser().parse_args(["serve", "--backend", "hf", "--model", "SmolLM2-135M-Instruct"]))
