"""``--header-timeout-s`` on a live uvicorn (server/header_timeout.py): a client that dribbles its
headers, one line at a time, is disconnected within the timeout; one that sends nothing too; a request
whose headers are complete is never cut by it, however long its response takes, and a keep-alive
connection serves a second request after a pause."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from eagle3.server.app import create_app
from eagle3.server.header_timeout import header_timeout_protocol
from eagle3.server.serve import uvicorn_config
from tests.unit.test_server_app import FakeBackend, settings

TIMEOUT_S = 1.0


@contextmanager
def live(config: uvicorn.Config) -> Iterator[int]:
    """``config`` served by uvicorn on a thread; yields the port."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


def closed_after_s(sock: socket.socket, lines: list[bytes], every_s: float, limit_s: float) -> float | None:
    """Send ``lines`` one per ``every_s`` (then nothing) until the server closes; seconds until it did,
    or None if it was still open after ``limit_s``."""
    started = time.monotonic()
    sock.settimeout(every_s)
    sent = 0
    while time.monotonic() - started < limit_s:
        if sent < len(lines):
            try:
                sock.sendall(lines[sent])
            except OSError:  # reset by the close
                return time.monotonic() - started
            sent += 1
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - started
    return None


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    s = settings(header_timeout_s=TIMEOUT_S, port=0)
    app = create_app(s, FakeBackend(tmp_path_factory.mktemp("ht")))
    with live(uvicorn_config(s, app)) as bound:
        yield bound


def test_a_client_dribbling_header_lines_is_disconnected_within_the_timeout(port: int) -> None:
    lines = [b"GET /v1/info HTTP/1.1\r\n", *[f"X-Slow-{i}: {i}\r\n".encode() for i in range(50)]]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        took = closed_after_s(sock, lines, every_s=0.25, limit_s=10 * TIMEOUT_S)
    assert took is not None, f"still open after {10 * TIMEOUT_S} s of dribbled headers"
    assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + 1.5, took


def test_a_silent_connection_is_closed_too(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        took = closed_after_s(sock, [], every_s=0.25, limit_s=10 * TIMEOUT_S)
    assert took is not None and took <= TIMEOUT_S + 1.5, took


def test_keep_alive_serves_a_second_request_after_a_pause(port: int) -> None:
    request = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for _ in range(2):
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT_S / 2)


def test_a_response_longer_than_the_timeout_is_not_cut(tmp_path: Path) -> None:
    async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await asyncio.sleep(3 * TIMEOUT_S)  # headers long complete, the response still running
        await send({"type": "http.response.body", "body": b"done"})

    config = uvicorn.Config(slow_app, port=0, http=header_timeout_protocol(TIMEOUT_S), log_config=None, lifespan="off")
    with live(config) as bound, socket.create_connection(("127.0.0.1", bound)) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while not got.endswith(b"done"):
            chunk = sock.recv(4096)
            assert chunk, f"closed mid-response after {got!r}"
            got += chunk
    assert got.startswith(b"HTTP/1.1 200")
