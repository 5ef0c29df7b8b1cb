"""Exact resume: a run killed (SIGKILL) and stopped (SIGTERM) midway, then resumed, follows the same
loss curve as an uninterrupted run (with dropout on, so its random masks resume too); SIGTERM leaves a
checkpoint and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagle3.draft_trainer.checkpoint import CHECKPOINT_FILE
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.trackers import RUN_ID_FILE
from eagle3.draft_trainer.train import METRICS_FILE, train
from tests.trainer_helpers import training_files

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    files = training_files(tmp_path_factory.mktemp("resume"), 48, seed=2)
    return {**files, "ttt_steps": "3",
            "max_batch_tokens": "96", "epochs": "40", "checkpoint_every_steps": "3", "progress": "false",
            "lr": "3e-3", "warmup_steps": "5", "dropout": "0.1"}  # fmt: skip  # dropout: its masks resume too


def _losses(run: Path) -> list[tuple[int, float]]:
    lines = (run / METRICS_FILE).read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _start(settings: dict[str, str], run: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "eagle3.train", "--features", settings["features"],
            "--vocab", settings["vocab"], "--model", settings["model"], "--out", str(run)]  # fmt: skip
    for key, value in settings.items():
        if key not in ("features", "vocab", "model"):
            args += ["--set", f"{key}={value}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for_step(proc: subprocess.Popen[bytes], run: Path, min_step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()[-2000:]
        if (run / CHECKPOINT_FILE).exists() and (run / METRICS_FILE).exists() and _losses(run)[-1:] \
                and _losses(run)[-1][0] >= min_step:  # fmt: skip
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {min_step} within {timeout_s} s")


def test_killed_and_stopped_run_resumes_to_the_same_curve(setup: dict[str, str], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    reference = train(load_config(None, dict(setup, out=str(tmp_path / "reference"))))
    want = _losses(tmp_path / "reference")
    total = reference.steps
    assert total >= 30

    run = tmp_path / "interrupted"
    proc = _start(setup, run)
    _wait_for_step(proc, run, 4)
    proc.send_signal(signal.SIGKILL)  # no chance to save: resume from the last periodic checkpoint
    proc.wait()
    killed_at = torch.load(run / CHECKPOINT_FILE, weights_only=True)["step"]
    assert 0 < killed_at < total

    proc = _start(setup, run)
    _wait_for_step(proc, run, killed_at + 4)
    proc.send_signal(signal.SIGTERM)  # saves a checkpoint at the end of the current step, exits 0
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"stopped by SIGTERM" in out
    stopped_at = torch.load(run / CHECKPOINT_FILE, weights_only=True)["step"]
    assert killed_at < stopped_at < total

    resumed = train(load_config(None, dict(setup, out=str(run))))
    assert resumed.steps == total
    got = _losses(run)
    assert [s for s, _ in got] == list(range(1, total + 1))  # each step logged once, none lost or repeated
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5, atol=1e-6)
    assert resumed.heldout["heldout_acc"] == pytest.approx(reference.heldout["heldout_acc"], abs=1e-6)
    assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_epoch_trains_every_sample_once(setup: dict[str, str], tmp_path: Path) -> None:
    """Reshuffled epochs pack into a varying number of micro-batches; none may be dropped."""
    from eagle3.draft_trainer.train import Trainer

    cfg = load_config(None, dict(setup, out=str(tmp_path / "run"), epochs="6"))
    trainer = Trainer(cfg)
    counts = {len(trainer.plan(epoch)) for epoch in range(cfg.epochs)}
    assert len(counts) > 1, "the fixture should give epochs of different micro-batch counts"
    for epoch in range(cfg.epochs):
        seen = [
            pos
            for step in range(epoch * trainer.steps_per_epoch, (epoch + 1) * trainer.steps_per_epoch)
            for batch in trainer.my_micro_batches(step)
            for pos in batch
        ]
        assert sorted(seen) == sorted(trainer.data.split.train), f"epoch {epoch}"


def test_metrics_reach_tensorboard_and_wandb(
    setup: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``log_to=tensorboard,wandb``: the records of metrics.jsonl reach TensorBoard's event files (read back
    with its own reader) and a real offline W&B run (draft_trainer/trackers.py)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sent: list[tuple[int, dict[str, float]]] = []  # what reached the real (offline) wandb run's log()
    real_init = wandb.init

    def spying_init(*args: Any, **kwargs: Any) -> Any:
        run = real_init(*args, **kwargs)
        real_log = run.log

        def log(data: dict[str, float], step: int) -> None:
            sent.append((step, dict(data)))
            real_log(data, step=step)

        run.log = log  # type: ignore[method-assign,assignment]
        return run

    monkeypatch.setattr(wandb, "init", spying_init)
    torch.set_num_threads(1)
    run = tmp_path / "run"
    cfg = load_config(None, dict(setup, out=str(run), max_steps="4", log_to="tensorboard,wandb"))
    result = train(cfg)

    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert len(losses) == result.steps == 4
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged.keys() == losses.keys()
    assert all(abs(logged[s] - losses[s]) <= 1e-6 * max(1.0, abs(losses[s])) for s in losses)
    assert "heldout/heldout_tau" in events.Tags()["scalars"]

    run_id = (run / RUN_ID_FILE).read_text().strip()
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0  # wandb's own offline record of the run
    assert [(step, data["loss"]) for step, data in sent if "loss" in data] == sorted(losses.items())
    assert sent[-1][1]["heldout_tau"] == pytest.approx(result.heldout["heldout_tau"])  # the final record


def test_unknown_or_missing_tracker_fails_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"unknown tracker 'mlflow' \(known: tensorboard, wandb\)"):
        load_config(None, {"log_to": "mlflow"})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="log_to=wandb needs the wandb package: pip install wandb"):
        load_config(None, {"log_to": "wandb"})
