"""``eagle3 train --server``: training streamed from live extraction servers (``draft_trainer/stream_data.py``,
``client/train_source.py``) equals training on a features directory of the same data and seed, in the
consume-once and hybrid modes, and through the faults of issue 33: the trainer SIGKILLed and resumed,
the server SIGKILLed mid-epoch and restarted, one of two servers gone. Deterministic server refusals
(a sample too long, token ids out of range) fail before training, naming the sample.

The servers run the synthetic backend (states a pure function of (token id, position), batched equals
single, bitwise), shaped like the tiny verifier the trainer loads (hidden 64, 8 layers, SmolLM2's
tokenizer): the loss is meaningless, the equality is exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3.client.errors import NoServerAvailableError
from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.train_source import ServerSource
from eagle3.core.identity import tokenizer_sha256
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
from eagle3.core.protocol.prepared import PreparedMeta, PreparedSample, write_prepared
from eagle3.draft_trainer.checkpoint import CHECKPOINT_FILE, DRAFT_DIR, DRAFT_WEIGHTS
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.stream_data import StreamedData
from eagle3.draft_trainer.train import METRICS_FILE, train
from tests.e2e.live_server import REPO_ROOT, LiveServer, descendants, tiny_llama_dir
from tests.trainer_helpers import random_samples, write_vocab

pytestmark = pytest.mark.e2e
HIDDEN, LAYERS = 64, 8
SYNTHETIC = ["--backend", "synthetic", "--synthetic-hidden-size", str(HIDDEN), "--synthetic-num-layers", str(LAYERS),
             "--dtype", "bfloat16"]  # fmt: skip
TRAIN = {"ttt_steps": "2", "max_batch_tokens": "96", "epochs": "3", "checkpoint_every_steps": "2",
         "progress": "false", "lr": "3e-3", "warmup_steps": "2", "heldout_fraction": "0.1", "device": "cpu",
         "prefetch_micro_batches": "2"}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("stream")
    model = tiny_llama_dir(root / "model", tokenizer_from=resolve_model_dir(DEFAULT_MODEL), n_layers=LAYERS)
    vocab_size = int(json.loads((model / "config.json").read_text())["vocab_size"])
    samples = random_samples(40, vocab_size, min_len=8, max_len=40, seed=3)
    prepared = root / "prepared"
    write_prepared(prepared, samples, _prepared_meta(model, vocab_size), {})
    write_vocab(samples, root / "vocab", vocab_size, vocab_size)  # every teacher argmax is in it: random states
    return {"root": root, "model": model, "prepared": prepared, "vocab": root / "vocab", "vocab_size": vocab_size}


def _prepared_meta(model: Path, vocab_size: int) -> PreparedMeta:
    return PreparedMeta(model=str(model), model_dir=str(model), tokenizer_sha256=tokenizer_sha256(model),
                        chat_template_sha256="test", vocab_size=vocab_size, max_length=256, overlong="drop",
                        inputs=["test"])  # fmt: skip


def _server(root: Path, name: str, *extra: str, port: int | None = None) -> LiveServer:
    server = LiveServer([*SYNTHETIC, "--model", str(root / "model"), *extra], root / f"{name}.log", port=port)
    server.wait_ready(timeout_s=180)
    return server


@pytest.fixture(scope="module")
def server(files: dict[str, Any]) -> Any:
    with _server(files["root"], "server") as live:
        yield live


def _cfg(files: dict[str, Any], out: Path, **extra: str) -> Any:
    return load_config(None, {**TRAIN, "vocab": str(files["vocab"]), "model": str(files["model"]), "out": str(out),
                              **extra})  # fmt: skip


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / DRAFT_DIR / DRAFT_WEIGHTS))


def _losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _assert_same_run(run: Path, reference: Path) -> None:
    got_losses, want_losses = _losses(run), _losses(reference)
    assert [s for s, _ in got_losses] == [s for s, _ in want_losses]  # every step once, none lost or repeated
    np.testing.assert_allclose([v for _, v in got_losses], [v for _, v in want_losses], rtol=1e-5, atol=1e-6)
    got, want = _weights(run), _weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def offline(files: dict[str, Any], server: LiveServer) -> dict[str, Any]:
    """The reference: eagle3 extract to a features directory, then train on it."""
    features = files["root"] / "features"
    extract_dataset(files["prepared"], features, server.url, config=ExtractConfig(progress=False, shard_mb=0.05))
    run = files["root"] / "offline"
    result = train(_cfg(files, run, features=str(features)))
    return {"features": features, "run": run, "result": result}


def _threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("eagle3-prefetch")]


def test_streamed_batches_equal_the_features_directory_bitwise(
    files: dict[str, Any], server: LiveServer, offline: dict[str, Any]
) -> None:
    disk = FeaturesData(offline["features"], heldout_fraction=0.1)
    stream = StreamedData(files["prepared"], ServerSource([server.url]), heldout_fraction=0.1, max_batch_tokens=96,
                          prefetch_micro_batches=2)  # fmt: skip
    try:
        assert stream.ids == disk.ids and stream.split == disk.split
        np.testing.assert_array_equal(stream.n_tokens, disk.n_tokens)
        plans = [disk.plan(disk.split.train, 96, seed=0, epoch=e) for e in range(2)]
        assert plans == [stream.plan(stream.split.train, 96, seed=0, epoch=e) for e in range(2)]
        order = [b for plan in plans for b in plan]
        stream.begin(iter(order))
        for positions in order + [list(disk.split.heldout)]:  # the held-out batch: outside the plan
            got, want = stream.load(positions), disk.load(positions)
            for field in ("input_ids", "aux", "final", "loss_mask", "positions", "seg_start", "seg_end"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
        stats = stream.stats()
        assert stats["fetched_samples"] == sum(len(b) for b in order)  # the held-out batch: fetched outside
        assert stats["prefetch_bytes"] == 2 * 96 * (4 * HIDDEN * 2 + 5)  # micro-batches x tokens x (L H 2 B, ids, mask)
    finally:
        stream.close()
    assert not _threads_left()


def test_consume_once_and_hybrid_train_the_same_draft(
    files: dict[str, Any], server: LiveServer, offline: dict[str, Any]
) -> None:
    root = files["root"]
    once = train(_cfg(files, root / "once", prepared=str(files["prepared"])), ServerSource([server.url]))
    _assert_same_run(root / "once", offline["run"])
    assert once.heldout["heldout_acc"] == pytest.approx(offline["result"].heldout["heldout_acc"], abs=1e-6)
    records = [json.loads(line) for line in (root / "once" / METRICS_FILE).read_text().splitlines()]
    epochs = [r for r in records if r.get("epoch_data")]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    n_train_tokens = sum(int(n) for n in FeaturesData(offline["features"], heldout_fraction=0.1).n_tokens[
        list(FeaturesData(offline["features"], heldout_fraction=0.1).split.train)])  # fmt: skip
    # consume once: every epoch fetches it all (the prefetch runs ahead into the next epoch: sums, not each)
    assert sum(r["fetched_tokens"] for r in epochs) == 3 * n_train_tokens
    assert all(0 <= r["data_wait_share"] <= 1 and r["tokens_per_s"] > 0 for r in epochs)
    assert all(0 <= r["server_idle_share"] <= 1 for r in epochs)

    cache = root / "cache"
    hybrid = root / "hybrid"
    train(_cfg(files, hybrid, prepared=str(files["prepared"]), features_cache=str(cache)), ServerSource([server.url]))
    _assert_same_run(hybrid, offline["run"])
    epochs = [json.loads(line) for line in (hybrid / METRICS_FILE).read_text().splitlines()]
    fetched = [r["fetched_tokens"] for r in epochs if r.get("epoch_data")]
    assert sum(fetched) == n_train_tokens and fetched[-1] == 0  # each sample fetched once; then the cache
    cached = FeaturesData(cache, heldout_fraction=0.1)  # the cache is a features directory like any other
    assert cached.ids == FeaturesData(offline["features"], heldout_fraction=0.1).ids
    assert not _threads_left()


def test_deterministic_refusals_name_the_sample(files: dict[str, Any], server: LiveServer) -> None:
    root, vocab_size = files["root"], files["vocab_size"]
    bad = [PreparedSample("ok", [5, 6, 7], [0, 1, 1]), PreparedSample("bad-ids", [5, vocab_size + 3], [0, 1])]
    write_prepared(root / "bad", bad, _prepared_meta(files["model"], vocab_size), {})
    with pytest.raises(DataError, match="'bad-ids'.*vocabulary"):
        StreamedData(root / "bad", ServerSource([server.url]))
    long_ones = [PreparedSample("short", [5] * 10, [1] * 10), PreparedSample("too-long", [5] * 200, [1] * 200)]
    write_prepared(root / "long", long_ones, _prepared_meta(files["model"], vocab_size), {})
    with _server(root, "short-server", "--max-model-len", "64") as short:
        with pytest.raises(DataError, match="'too-long' .* 200 tokens, over the servers' limit of 64"):
            StreamedData(root / "long", ServerSource([short.url]))
        # past the trainer's own check (a server restarted with a lower limit): the server's answer names it
        source = ServerSource([short.url])
        source.open(root / "long", 2)
        with pytest.raises(Exception, match="too-long") as caught:
            list(source.fetch(long_ones, 0))
        assert "retry" not in type(caught.value).__name__.lower()
        source.close()


def _train_thread(cfg: Any, source: ServerSource) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = train(cfg, source)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, name="stream-train")
    thread.start()
    return thread, out


def _wait_step(run: Path, step: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run / METRICS_FILE).is_file() and any(s >= step for s, _ in _losses(run)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{run}: no step {step} in {timeout_s} s")


def test_server_killed_mid_epoch_and_restarted(files: dict[str, Any], offline: dict[str, Any]) -> None:
    root = files["root"]
    slow = ["--synthetic-tokens-per-s", "2000"]  # ~1 s per epoch's worth of a few micro-batches: time to kill
    first = _server(root, "killed", *slow)
    port = first.port
    run = root / "server-killed"
    thread, out = _train_thread(_cfg(files, run, prepared=str(files["prepared"])), ServerSource([first.url]))
    try:
        _wait_step(run, 3)
        first.process.send_signal(signal.SIGKILL)
        first.stop()
        time.sleep(2.0)  # the trainer stalls, retrying
        with _server(root, "restarted", *slow, port=port):
            thread.join(300)
    finally:
        first.stop()
    assert not thread.is_alive() and "error" not in out, out.get("error")
    _assert_same_run(run, offline["run"])
    assert not _threads_left()


def test_one_of_two_servers_gone(files: dict[str, Any], offline: dict[str, Any]) -> None:
    root = files["root"]
    slow = ["--synthetic-tokens-per-s", "2000"]
    with _server(root, "stays", *slow) as stays:
        gone = _server(root, "gone", *slow)
        run = root / "two-servers"
        thread, out = _train_thread(_cfg(files, run, prepared=str(files["prepared"])),
                                    ServerSource([gone.url, stays.url]))  # fmt: skip
        try:
            _wait_step(run, 3)
            gone.process.send_signal(signal.SIGKILL)
            thread.join(300)
        finally:
            gone.stop()
    assert not thread.is_alive() and "error" not in out, out.get("error")
    _assert_same_run(run, offline["run"])


def test_trainer_sigkill_then_resume(files: dict[str, Any], server: LiveServer, offline: dict[str, Any]) -> None:
    """A hybrid run SIGKILLed after its checkpoint at step 2 resumes at it and ends equal to the
    uninterrupted run; the cache keeps what was written and the restart fetches only the rest."""
    root = files["root"]
    run, cache = root / "killed-trainer", root / "killed-cache"
    args = [sys.executable, "-m", "eagle3", "train", "--prepared", str(files["prepared"]), "--server", server.url,
            "--features-cache", str(cache), "--vocab", str(files["vocab"]), "--model", str(files["model"]),
            "--out", str(run)]  # fmt: skip
    for key, value in TRAIN.items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ((run / CHECKPOINT_FILE).exists() and any(s >= 3 for s, _ in _losses(run))):
            assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not descendants(proc.pid)
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_same_run(run, offline["run"])
    assert [s for s, _ in _losses(run)] == sorted({s for s, _ in _losses(run)})  # no step logged twice


def test_a_loading_server_is_waited_for_by_default(files: dict[str, Any]) -> None:
    """``eagle3 train --server`` waits for a verifier still loading as ``eagle3 extract`` does (by default as
    long as the server expects to load, and then some); ``--wait-ready-s 0`` does not wait. Before, it never
    waited: a trainer started beside a loading server failed at once."""
    root = files["root"]
    starting = LiveServer([*SYNTHETIC, "--model", str(root / "model")], root / "starting.log")  # not ready yet
    try:
        no_wait = ServerSource(starting.url, wait_ready_s=0)
        with pytest.raises(NoServerAvailableError, match="answers /v1/info"):
            no_wait.open(files["prepared"], 40)
        no_wait.close()
        waiting = ServerSource(starting.url)
        meta, longest = waiting.open(files["prepared"], 40)
        waiting.close()
        assert meta.hidden_size > 0 and longest > 0
    finally:
        starting.stop()


@pytest.fixture(scope="module")
def offline_accum2(files: dict[str, Any], offline: dict[str, Any]) -> Path:
    """Two ranks' reference: one process on the features directory, the same global batch (2 micro-batches a step)."""
    reference: Path = files["root"] / "offline-accum2"
    train(_cfg(files, reference, features=str(offline["features"]), grad_accum_steps="2"))
    return reference


def _torchrun_args(files: dict[str, Any], url: str, run: Path, port: int, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            "-m", "eagle3.train", "--prepared", str(files["prepared"]), "--server", url, *extra,
            "--vocab", str(files["vocab"]), "--model", str(files["model"]), "--out", str(run)]  # fmt: skip
    for key, value in TRAIN.items():
        args += ["--set", f"{key}={value}"]
    return args


TORCHRUN_ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


def _torchrun(files: dict[str, Any], server: LiveServer, run: Path, port: int, *extra: str) -> None:
    args = _torchrun_args(files, server.url, run, port, *extra)
    proc = subprocess.run(args, cwd=REPO_ROOT, env=TORCHRUN_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_same_as_two_ranks(run: Path, reference: Path) -> None:
    got, want = _losses(run), _losses(reference)
    assert [s for s, _ in got] == [s for s, _ in want] and len(got) > 5
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-4, atol=1e-5)
    for name, tensor in _weights(reference).items():
        torch.testing.assert_close(_weights(run)[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_torchrun_consume_once(files: dict[str, Any], server: LiveServer, offline_accum2: Path) -> None:
    """Two gloo ranks streaming their own micro-batches equal one process with the same global batch. Its
    epoch 2 packs into 9 micro-batches over 5 steps of 2, so rank 1 has none in the last step: before
    ``all_reduce_grads`` this run crashed there (gloo: a collective size mismatch)."""
    run = files["root"] / "ddp-once"
    _torchrun(files, server, run, 29532)
    _assert_same_as_two_ranks(run, offline_accum2)


def test_torchrun_hybrid_cache_is_fetched_once_across_ranks(
    files: dict[str, Any], server: LiveServer, offline: dict[str, Any], offline_accum2: Path
) -> None:
    """Hybrid under torchrun: each rank writes its own directory of the cache (``CACHE/rank-N``) and reads
    every rank's after each epoch's barrier, so every sample is fetched once in all (not once per rank
    that trains it), the run equals one process with the same global batch, and the cache reads back as
    one features directory (offline, and as a hybrid cache of a one-process run that fetches nothing)."""
    root = files["root"]
    cache, run = root / "ddp-cache", root / "ddp-hybrid"
    _torchrun(files, server, run, 29533, "--features-cache", str(cache))
    _assert_same_as_two_ranks(run, offline_accum2)

    epochs = [r for r in map(json.loads, (run / METRICS_FILE).read_text().splitlines()) if r.get("epoch_data")]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert epochs[0]["fetched_tokens"] > 0 and [r["fetched_tokens"] for r in epochs[1:]] == [0, 0]  # rank 0
    per_rank = [FeaturesData(cache / f"rank-{r}", heldout_fraction=0.1).ids for r in (0, 1)]
    assert per_rank[0] and per_rank[1] and not set(per_rank[0]) & set(per_rank[1])  # none fetched twice
    disk = FeaturesData(offline["features"], heldout_fraction=0.1)
    union = FeaturesData(cache, heldout_fraction=0.1)  # --features reads the ranks' directories as one
    assert union.ids == disk.ids
    for pos in (0, len(disk.ids) // 2, len(disk.ids) - 1):
        assert np.array_equal(union.sample(pos).states, disk.sample(pos).states)

    again = root / "one-process-on-the-ddp-cache"
    train(_cfg(files, again, prepared=str(files["prepared"]), features_cache=str(cache)), ServerSource([server.url]))
    _assert_same_run(again, offline["run"])
    records = [json.loads(line) for line in (again / METRICS_FILE).read_text().splitlines()]
    assert [r["fetched_tokens"] for r in records if r.get("epoch_data")] == [0, 0, 0]


def _rank_pid(agent: int, rank: int) -> int:
    for pid, _ in descendants(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"eagle3.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {agent}")


def test_torchrun_sigterm_to_one_rank_stops_every_rank_at_one_step(files: dict[str, Any], offline_accum2: Path) -> None:
    """A preemption's SIGTERM reaches the ranks at different moments; here only rank 1 gets one. Every rank
    stops after the same step (they agree on it each step), rank 0 saves the checkpoint, torchrun exits 0,
    and the rerun resumes to the same draft as one process with the same global batch. Before, rank 1
    left alone and rank 0 died in the next all-reduce ("Connection reset by peer"): no checkpoint saved,
    torchrun failed."""
    root = files["root"]
    run = root / "ddp-sigterm"
    with _server(root, "sigterm-server", "--synthetic-tokens-per-s", "2000") as slow:  # a step takes ~0.1 s
        args = _torchrun_args(files, slow.url, run, 29535)
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=TORCHRUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            _wait_step(run, 3)
            os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out.decode()[-3000:]
        assert b"stopped by SIGTERM" in out
        stopped_at = torch.load(run / CHECKPOINT_FILE, weights_only=False)["step"]
        assert 3 <= stopped_at < _losses(offline_accum2)[-1][0]
        assert not (run / "heldout.json").exists()  # stopped: no final evaluation on any rank
        done = subprocess.run(args, cwd=REPO_ROOT, env=TORCHRUN_ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_same_as_two_ranks(run, offline_accum2)


def _ranks_of(run: Path) -> list[int]:
    """Live processes whose command line trains ``run``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if entry.name.isdigit() and str(run).encode() in cmdline and b"eagle3.train" in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_torchrun_hybrid_sigkilled_then_resumed(
    files: dict[str, Any], server: LiveServer, offline_accum2: Path
) -> None:
    """A torchrun launcher SIGKILLed after a checkpoint: its ranks (torchrun starts each in a session of
    its own, so the kill does not reach them) stop within seconds instead of training on orphaned and
    holding the cache's locks, which refused the rerun (``ranks.watch_launcher``). The rerun resumes:
    each rank reopens its own cache directory (repaired, the shards in flight lost) and reads the
    others'; the draft equals one process with the same global batch."""
    root = files["root"]
    run, cache = root / "ddp-killed", root / "ddp-killed-cache"
    args = _torchrun_args(files, server.url, run, 29536, "--features-cache", str(cache))
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=TORCHRUN_ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((run / CHECKPOINT_FILE).exists() and any(s >= 3 for s, _ in _losses(run))):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: not the ranks, in sessions of their own
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10  # the ranks (sessions of their own) see their launcher gone and stop
    while _ranks_of(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ranks_of(run), "ranks outlived their killed launcher"
    assert torch.load(run / CHECKPOINT_FILE, weights_only=False)["step"] < _losses(offline_accum2)[-1][0]
    done = subprocess.run(args, cwd=REPO_ROOT, env=TORCHRUN_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_same_as_two_ranks(run, offline_accum2)
    assert (
        FeaturesData(cache, heldout_fraction=0.1).ids == FeaturesData(run.parent / "features", heldout_fraction=0.1).ids
    )
