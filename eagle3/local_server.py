"""A local ``eagle3 serve`` subprocess: what ``eagle3 demo`` and the benchmarks talk to over HTTP.

``LocalServer(args).start()`` launches ``python -m eagle3 serve`` on a free loopback port with its log
in a file, ``wait_ready`` polls ``/readyz`` (printing the load phase when asked) and raises
``LocalServerError`` with the log's tail if the process exits (a configuration error exits with status 2)
or reports ``failed`` (a load failure: waiting longer cannot help); ``stop`` sends SIGTERM (the server
drains) and kills after ``stop_timeout_s``.
Used as a context manager it always stops the process, also on KeyboardInterrupt.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from eagle3.core.errors import Eagle3Error

REPO_ROOT = Path(__file__).resolve().parents[1]


class LocalServerError(Eagle3Error, RuntimeError):
    """The local ``eagle3 serve`` exited, failed to load, or was not ready in time (the message ends with
    the tail of its log)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water resident set (VmHWM), 0 when unknown."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM it when the process that started it dies, even by
    SIGKILL, so a killed test run or demo never leaves its server (and the server's engines, which die
    with it: server/backends/engine_guard.py) behind. A no-op elsewhere."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class LocalServer:
    def __init__(self, args: Sequence[str], log_path: Path, stop_timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> LocalServer:
        cmd = [sys.executable, "-m", "eagle3", "serve", "--port", str(self.port), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(  # noqa: S603 (our own command line)
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )
        return self

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0, on_phase: Callable[[str], None] | None = None) -> None:
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        last_phase = ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LocalServerError(f"eagle3 serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=5.0)
                if response.status_code == 200:
                    return
                body = response.json()
                phase = str(body.get("phase", ""))
                if body.get("status") == "failed":
                    raise LocalServerError(
                        f"eagle3 serve could not load the model ({phase}){self._exit_after_failed()}"
                    )
                if on_phase is not None and phase and phase != last_phase:
                    on_phase(phase)
                last_phase = phase
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
        raise LocalServerError(f"eagle3 serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _exit_after_failed(self, grace_s: float = 5.0) -> str:
        """The rest of a failed load's message: a configuration error makes ``eagle3 serve`` exit 2 a moment
        after /readyz says ``failed`` (server/serve.py), so wait ``grace_s`` for that exit to report it too."""
        assert self.process is not None
        try:
            status = self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return f":\n{self.log_tail()}"  # still up: a failure a restart may cure
        return f" and exited with {status}:\n{self.log_tail()}"

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.process.pid) if self.process is not None else 0

    def stop(self) -> int | None:
        """SIGTERM (drain), then SIGKILL after ``stop_timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def __enter__(self) -> LocalServer:
        return self.start() if self.process is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
