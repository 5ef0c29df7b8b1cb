"""A server started through ``eagle3.local_server.LocalServer`` (the demo's, the benches') dies with the
process that started it, even when that process is SIGKILLed and runs no cleanup
(``die_with_parent``: PR_SET_PDEATHSIG). The starter here is a real separate Python process that
starts a synthetic-backend server (fast to load), prints the server's pid once it is ready, then
sleeps until it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux")]

STARTER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from eagle3.local_server import LocalServer

    server = LocalServer(["--backend", "synthetic", "--synthetic-hidden-size", "64",
                          "--synthetic-num-layers", "8"], Path(sys.argv[1]))
    server.start()
    server.wait_ready(timeout_s=120)
    print(server.process.pid, flush=True)
    time.sleep(600)
    """
)


def _status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict; empty once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def _gone(pid: int, timeout_s: float) -> bool:
    """The process exited (reaped, or a zombie waiting for its new parent) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _status(pid).get("State", "")
        if not state or state.startswith("Z"):
            return True
        time.sleep(0.1)
    return False


def test_server_dies_when_its_starter_is_sigkilled(tmp_path: Path) -> None:
    server_pid = 0
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"starter printed {line!r}; server log:\n{(tmp_path / 'server.log').read_text()}"
        server_pid = int(line)
        cmdline = Path(f"/proc/{server_pid}/cmdline").read_bytes().split(b"\0")
        assert int(_status(server_pid)["PPid"]) == starter.pid and b"serve" in cmdline
        os.kill(starter.pid, signal.SIGKILL)  # no finally, no atexit, no context manager exit runs
        starter.wait(timeout=10)
        assert _gone(server_pid, timeout_s=30), f"server {server_pid} still alive 30 s after its starter was killed"
    finally:
        if starter.poll() is None:
            starter.kill()
        if server_pid and _status(server_pid):  # only when an assertion above failed
            os.kill(server_pid, signal.SIGKILL)
