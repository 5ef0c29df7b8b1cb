"""``eagle3 serve`` exits with status 2 on a configuration error (as ``vllm serve`` does) and stays up,
``failed`` on /readyz with /livez 200, only for a load failure a restart may cure.

A configuration error found before the port is bound (a bad ``--config`` entry, a ``--model`` that names
nothing) and one found while loading (``--aux-layer-ids`` outside the model, an unknown ``--engine-arg``
in the vllm backend, which needs vLLM imported to know the names) end the same way: status 2 and one
line naming the setting. A checkpoint whose weights cannot be read (a truncated download) is not a
setting: the server stays up and says so on /readyz until it is restarted (or drained).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3.server.backends import BackendConfigError, BackendError, BackendInfo
from eagle3.server.load_checks import retry_could_cure
from eagle3.server.runtime import Runtime
from tests.e2e.live_server import REPO_ROOT, LiveServer, tiny_llama_dir
from tests.unit.test_server_app import FakeBackend, settings

pytestmark = pytest.mark.e2e


class FailingBackend(FakeBackend):
    def __init__(self, model_dir: Path, exc: Exception) -> None:
        super().__init__(model_dir)
        self.exc = exc

    def load(self, progress: object) -> BackendInfo:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "exit_status"),
    [
        (BackendConfigError("--aux-layer-ids: aux layer ids [99] must be in [0, 8)"), 2),
        (BackendError("CUDA out of memory"), None),
        (RuntimeError("connection reset while downloading"), None),
    ],
)
def test_only_a_configuration_error_sets_an_exit_status(
    tmp_path: Path, exc: Exception, exit_status: int | None
) -> None:
    runtime = Runtime(settings(), FailingBackend(tmp_path, exc))
    try:
        runtime._load()
        assert runtime.status == "failed" and runtime.phase.startswith(f"failed: {type(exc).__name__}")
        assert runtime.exit_status == exit_status
        assert retry_could_cure(exc) is (exit_status is None)
    finally:
        runtime.stop()


def _exit_of(server: LiveServer, timeout_s: float = 120.0) -> int:
    try:
        return server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve still up {timeout_s:.0f} s after a configuration error:\n{server.log()}")


def test_a_setting_the_model_cannot_load_with_exits_2(tmp_path: Path) -> None:
    model = tiny_llama_dir((tmp_path / "tiny").resolve())  # 8 layers
    server = LiveServer(["--model", str(model), "--aux-layer-ids", "1,2,99"], tmp_path / "server.log")
    try:
        assert _exit_of(server) == 2, server.log()
        log = server.log()
        assert "eagle3 serve: listening on" in log  # it was found while loading, after the port was bound
        assert "eagle3 serve: error: BackendConfigError: --aux-layer-ids" in log, log
        assert "Traceback" not in log
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--model", "dummy:gpt-9"], "unknown dummy shape 'gpt-9'"),
        (["--model", "dummy:tiny", "--config", "{config}"], "unknown setting(s) ['max_batch_size']"),
    ],
)
def test_a_bad_setting_found_before_binding_exits_2(tmp_path: Path, args: list[str], message: str) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_batch_size: 4096\n")
    args = [a.format(config=config) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3", "serve", "--backend", "hf", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_load_failure_a_restart_may_cure_stays_up_as_failed(tmp_path: Path) -> None:
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted download
    server = LiveServer(["--model", str(model)], tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.process.poll() is None, server.log()
            try:
                ready = httpx.get(f"{server.url}/readyz", timeout=2.0)
                if ready.json().get("status") == "failed":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        assert ready.status_code == 503
        time.sleep(1.0)  # a configuration error would have ended the process by now
        assert server.process.poll() is None, server.log()
        assert httpx.get(f"{server.url}/livez", timeout=2.0).status_code == 200
        # the start-up line of the settings not at their default, each with its source
        assert f"settings not at their default: model='{model}' (--model), backend='hf' (--backend)" in server.log()
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_arg_typo_exits_2_in_the_vllm_backend(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    server = LiveServer(
        ["--backend", "vllm", "--model", str(model), "--engine-arg", "kv_cache_gb=1"], tmp_path / "server.log"
    )
    try:
        assert _exit_of(server, 300) == 2, server.log()
        log = server.log()
        assert "eagle3 serve: error: BackendConfigError: --engine-arg" in log and "kv_cache_gb" in log, log
    finally:
        server.stop()


def test_the_demos_local_server_stops_waiting_at_a_failed_load(tmp_path: Path) -> None:
    """eagle3 demo waits up to 30 minutes for its server: a load that failed (or a server that exited
    on a configuration error) ends the wait at once with one Eagle3Error naming why."""
    from eagle3.local_server import LocalServer, LocalServerError

    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    # a configuration error exits 2 a moment after /readyz says failed: whichever the wait sees first, the
    # message names the exit (LocalServer waits a few seconds for it); a damaged file leaves the server up
    for args, message, exits in (
        (["--model", str(model)], "could not load the model (failed: ", False),
        (["--model", str(model), "--aux-layer-ids", "1,2,99"], "exited with 2:", True),
    ):
        started = time.monotonic()
        with (
            LocalServer(["--backend", "hf", *args], tmp_path / "local.log") as server,
            pytest.raises(LocalServerError, match=re.escape(message)) as raised,
        ):
            server.wait_ready(timeout_s=600)
        assert ("exited with" in str(raised.value)) == exits, str(raised.value)
        assert time.monotonic() - started < 120
