"""The SDK and ``eagle3 extract`` against a live ``eagle3 serve`` (the embedded SmolLM2 verifier).

(a) ``eagle3 extract`` writes exactly what ``ExtractionClient.extract`` returns; (b) an extract run
SIGKILLed midway and run again gives the same features as an uninterrupted run, sample for sample,
without duplicates or leftover files; (c) with one dead server URL of two, the run completes.

The server runs from this checkout; ``EAGLE3_E2E_SERVER_ROOT`` points the fixture at another
checkout's ``server`` package (used while the server and SDK were developed on separate branches).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eagle3.client.async_sdk import AsyncExtractionClient
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.client.sdk import ExtractionClient
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol import iter_prepared
from eagle3.core.protocol.features import MANIFEST_FILE, SHARDS_DIR, iter_manifest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_ROOT = Path(os.environ.get("EAGLE3_E2E_SERVER_ROOT", REPO_ROOT))
N_SAMPLES = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def eagle3(
    *args: str, root: Path = REPO_ROOT, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[Any]:
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "eagle3", *args], env=env, cwd=root, **kwargs)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (SERVER_ROOT / "server" / "app.py").is_file():
        pytest.skip(f"no server package in {SERVER_ROOT}")
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        backend = os.environ.get("EAGLE3_E2E_BACKEND", "hf")  # `--backend auto` would pick vllm
        # fp32: each sample's states are independent of what else shares its batch (bf16 pads groups of
        # samples into one forward call, equal only to bf16 rounding), so runs compare bitwise.
        # The verifier comes from $EAGLE3_MODEL (no --model): the variable satisfies serve's required --model.
        proc = eagle3("serve", "--port", str(port), "--backend", backend, "--max-batch-tokens", "1024",
                      "--dtype", "float32", "--heartbeat-s", "1", env={"EAGLE3_MODEL": DEFAULT_MODEL},
                      root=SERVER_ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"eagle3 serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(url + "/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"eagle3 serve not ready in 180 s:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("prep") / "prepared"
    prepare_dataset(["builtin:chatterbot"], out, model=DEFAULT_MODEL, config=PrepareConfig(limit=N_SAMPLES))
    return out


def run_extract(prepared: Path, out: Path, *urls: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    servers = [a for u in urls for a in ("--server", u)]
    args = ["extract", str(prepared), *servers, "--out", str(out), "--no-progress", *extra]
    proc = eagle3(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def reference(server_url: str, prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted ``eagle3 extract`` run."""
    out: Path = tmp_path_factory.mktemp("ref") / "features"
    result = run_extract(prepared, out, server_url)
    assert result.returncode == 0, result.stderr
    assert f"{N_SAMPLES} extracted, 0 already done, 0 failed" in result.stdout
    return out


def assert_same_features(got_dir: Path, want_dir: Path, *, exact: bool = True) -> None:
    """``got_dir`` holds the same dataset as ``want_dir``: each sample id once, the same ids, input ids
    and masks, hidden states bit for bit (``exact``; else within 1 % relative L2 per sample, for
    backends whose batching changes the rounding), every checksum right, no orphan or .tmp file."""
    got, want = FeaturesReader(got_dir, verify=True), FeaturesReader(want_dir, verify=True)
    assert len(got.sample_ids) == len(set(got.sample_ids)) == N_SAMPLES
    assert sorted(got.sample_ids) == sorted(want.sample_ids)
    for sample_id in want.sample_ids:
        a, b = got[sample_id], want[sample_id]
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        if exact:
            np.testing.assert_array_equal(a.hidden_states_bf16, b.hidden_states_bf16)
        else:
            x, y = a.hidden_states.astype(np.float64), b.hidden_states.astype(np.float64)
            assert np.linalg.norm(x - y) <= 1e-2 * np.linalg.norm(y), sample_id
    recorded = {r.shard for r in iter_manifest(got_dir)}
    assert {p.name for p in (got_dir / SHARDS_DIR).iterdir()} == recorded  # no orphans, no .tmp


def test_cli_features_equal_what_the_sdk_returns(server_url, prepared, reference):
    samples = list(iter_prepared(prepared))
    reader = FeaturesReader(reference, verify=True)
    assert reader.meta.hidden_size == 576 and reader.meta.aux_layer_ids == (2, 15, 27)
    with ExtractionClient(server_url) as client:
        info = client.info()
        got = list(client.extract(samples))
    assert reader.meta.revision == info.revision and reader.meta.final_layer_id == info.final_layer_id == 30
    assert [s.sample_id for s in got] == [s.sample_id for s in samples]
    for sample, from_sdk in zip(samples, got, strict=True):
        on_disk = reader[sample.sample_id]
        assert on_disk.input_ids.tolist() == sample.input_ids == from_sdk.input_ids.tolist()
        assert on_disk.loss_mask.tolist() == sample.loss_mask == from_sdk.loss_mask.tolist()
        assert from_sdk.hidden_states.shape == (sample.n_tokens, 4, 576)
        np.testing.assert_array_equal(on_disk.hidden_states_bf16, from_sdk.hidden_states_bf16)
        assert np.isfinite(from_sdk.final_hidden_state).all()


def test_sigkill_midway_then_rerun_equals_an_uninterrupted_run(server_url, prepared, reference, tmp_path):
    out = tmp_path / "features"
    args = ["extract", str(prepared), "--server", server_url, "--out", str(out), "--no-progress",
            "--shard-mb", "0.4", "--request-tokens", "128"]  # fmt: skip
    proc = eagle3(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = out / MANIFEST_FILE
    deadline = time.monotonic() + 300
    while not (manifest.is_file() and manifest.read_text().count("\n") >= 1):
        assert proc.poll() is None, "extract finished before it could be killed: make the run longer"
        assert time.monotonic() < deadline, "no shard recorded in 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    n_recorded = sum(len(r.sample_ids) for r in iter_manifest(out))
    assert 0 < n_recorded < N_SAMPLES
    (out / SHARDS_DIR / ".shard-000099-dead.safetensors.0000.tmp").write_bytes(b"torn write")  # as a crash leaves
    result = run_extract(prepared, out, server_url, extra=("--shard-mb", "0.4"))
    assert result.returncode == 0, result.stderr
    assert f"{N_SAMPLES - n_recorded} extracted, {n_recorded} already done" in result.stdout
    assert_same_features(out, reference)


def test_one_dead_server_of_two(server_url, prepared, reference, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = tmp_path / "features"
    result = run_extract(prepared, out, dead, server_url, extra=("--request-tokens", "256", "--max-retries", "2"))
    assert result.returncode == 0, result.stderr
    assert f"{N_SAMPLES} extracted" in result.stdout
    assert dead in result.stderr  # the failover was logged
    assert_same_features(out, reference)


def test_async_client_returns_what_the_sync_client_returns(server_url, prepared):
    """AsyncExtractionClient against the live server: the same samples bit for bit (awaited whole, and
    one by one in arrival order), chat messages included, and the same greedy generation."""
    samples: list[Any] = [*iter_prepared(prepared), [{"role": "user", "content": "What is a cat?"}]]
    prompt = [{"role": "user", "content": "Name a colour."}]
    with ExtractionClient(server_url) as client:
        want = list(client.extract(samples))
        want_reply = client.generate([prompt], max_new_tokens=8).replies[0]

    async def run() -> tuple[list[Any], Any, int]:
        async with AsyncExtractionClient(server_url) as client:
            got = await client.extract(samples)
            reply = (await client.generate([prompt], max_new_tokens=8)).replies[0]
            again = sorted([s async for s in client.extract(samples[:4], ordered=False)], key=lambda s: s.sample_id)
            return [got, again], reply, client.wire_bytes

    (got, again), reply, wire_bytes = asyncio.run(run())
    assert [s.sample_id for s in got] == [s.sample_id for s in want] and len(got) == N_SAMPLES + 1
    first4 = sorted(want[:4], key=lambda s: s.sample_id)
    for a, b in zip([*got, *again], [*want, *first4], strict=True):
        assert a.sample_id == b.sample_id
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_array_equal(a.hidden_states_bf16, b.hidden_states_bf16)
    assert reply.output_ids == want_reply.output_ids and len(reply.output_ids) > 0
    assert wire_bytes > 0
