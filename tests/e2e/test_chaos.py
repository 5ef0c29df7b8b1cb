"""Chaos: ``eagle3 serve`` SIGKILLed in the middle of an ``eagle3 extract`` run.

Asserted by process tree: every process the server started (vLLM's engine core and workers) is gone
within a few watchdog periods (server/backends/engine_guard.py), the dead server's ``/dev/shm``
handover directory is removed when the next server starts, and ``eagle3 extract`` rerun against the
new server completes the features directory: the same samples as an uninterrupted run against it,
without duplicates (hidden states bitwise equal on hf fp32; vLLM's packed batches differ between runs
only to fp32 rounding, so there they are compared to 1e-5 relative L2 per sample).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol.features import MANIFEST_FILE, iter_manifest
from eagle3.server.backends import engine_guard
from tests.e2e.live_server import LiveServer, descendants, tiny_llama_dir, wait_gone
from tests.e2e.test_sdk_live import N_SAMPLES, assert_same_features, eagle3, run_extract
from tests.e2e.test_sdk_live import prepared as prepared

pytestmark = pytest.mark.e2e
SHM = Path("/dev/shm")


def kill_mid_run(live: LiveServer, prepared_dir: Path, out: Path) -> list[tuple[int, str]]:
    """Start ``eagle3 extract``, SIGKILL the server once a shard is recorded; the server's descendants."""
    args = ["extract", str(prepared_dir), "--server", live.url, "--out", str(out), "--no-progress",
            "--shard-mb", "0.01", "--request-tokens", "64", "--max-retries", "0"]  # fmt: skip
    client = eagle3(*args, stdout=None, stderr=None)
    manifest = out / MANIFEST_FILE
    deadline = time.monotonic() + 300
    while not (manifest.is_file() and manifest.read_text().count("\n") >= 1):
        assert client.poll() is None, "extract finished before the server could be killed"
        assert time.monotonic() < deadline, "no shard recorded in 300 s"
        time.sleep(0.02)
    processes = descendants(live.process.pid)
    live.process.send_signal(signal.SIGKILL)
    assert live.process.wait(10) == -signal.SIGKILL
    assert client.wait(120) != 0  # no server left and no retries: it stops, its shards recorded
    return processes


def chaos_run(args: list[str], tmp_path: Path, prepared_dir: Path, ready_timeout_s: float) -> None:
    out, fresh = tmp_path / "features", tmp_path / "fresh"
    with LiveServer(args, tmp_path / "first.log") as first:
        first.wait_ready(ready_timeout_s)
        server_pid = first.process.pid
        handover = list(SHM.glob(f"{engine_guard.DIR_PREFIX}{server_pid}-*")) if SHM.is_dir() else []
        processes = kill_mid_run(first, prepared_dir, out)
    if "vllm" in args:  # the engine core and its worker(s), and the handover dir, existed
        assert processes and handover, (processes, handover)
    orphans = wait_gone(processes, timeout_s=10 * engine_guard.POLL_S)
    assert not orphans, f"processes of the SIGKILLed server still running: {orphans}"
    assert 0 < sum(len(r.sample_ids) for r in iter_manifest(out)) < N_SAMPLES
    with LiveServer(args, tmp_path / "second.log") as second:
        second.wait_ready(ready_timeout_s)
        assert not [p for p in handover if p.exists()], "the dead server's handover dir was not cleaned up"
        resumed = run_extract(prepared_dir, out, second.url, extra=("--shard-mb", "0.01"))
        assert resumed.returncode == 0, resumed.stderr
        assert "already done" in resumed.stdout and "0 failed" in resumed.stdout, resumed.stdout
        uninterrupted = run_extract(prepared_dir, fresh, second.url)
        assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert_same_features(out, fresh, exact="vllm" not in args)


def test_hf_server_sigkilled_mid_run_leaves_nothing_and_the_client_resumes(tmp_path: Path, prepared: Path) -> None:
    args = ["--backend", "hf", "--model", DEFAULT_MODEL, "--dtype", "float32", "--max-batch-tokens", "256",
            "--heartbeat-s", "1"]  # fmt: skip
    chaos_run(args, tmp_path, prepared, ready_timeout_s=180)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_sigkilled_mid_run_leaves_no_engine_and_the_client_resumes(
    tmp_path: Path, prepared: Path, smollm2_dir: Path
) -> None:
    from tests.integration.test_vllm_backend import require_vllm

    require_vllm()
    model = tiny_llama_dir(tmp_path / "tiny", tokenizer_from=smollm2_dir)
    args = ["--backend", "vllm", "--kv-cache-gib", "1", "--model", str(model), "--dtype", "float32",
            "--max-batch-tokens", "256", "--heartbeat-s", "1"]  # fmt: skip
    chaos_run(args, tmp_path, prepared, ready_timeout_s=600)
