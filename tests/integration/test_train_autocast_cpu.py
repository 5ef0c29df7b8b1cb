"""``autocast_bf16`` on CPU (the flag for CPUs with bf16 matrix units, e.g. AMX): a training step runs, its
loss matches the fp32 step's within bf16 tolerance, and so do the next steps' (same batches, the weights
updated under each). The CPU autocast casts fewer ops to fp32 than CUDA's does (``log_softmax`` stays bf16
there), so the teacher's log-probs are widened explicitly; before that the first step failed with a dtype
error."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.train import Trainer
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_vocab

pytestmark = pytest.mark.integration


def test_cpu_bf16_autocast_steps_match_fp32(tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    samples = random_samples(16, 97, seed=4)
    features = write_features(samples, tmp_path / "features", model)
    write_vocab(samples, tmp_path / "vocab", 97, 64)
    base = {"features": str(features), "vocab": str(tmp_path / "vocab"), "model": str(model), "ttt_steps": 3,
            "max_batch_tokens": 96, "epochs": 20, "lr": 1e-2, "warmup_steps": 1, "progress": False,
            "device": "cpu"}  # fmt: skip
    fp32 = Trainer(load_config(None, {**base, "out": str(tmp_path / "fp32")}))
    bf16 = Trainer(load_config(None, {**base, "out": str(tmp_path / "bf16"), "autocast_bf16": True}))
    assert bf16.autocast and not fp32.autocast
    for _ in range(5):
        want, got = fp32.train_step(), bf16.train_step()
        assert got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=5e-2)


def test_bf16_autocast_on_a_cpu_that_emulates_it_is_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The user's choice stands (the run is bf16), but the log says this CPU has no native bf16 and what to set,
    exactly when the probe measured it slow (an AVX2-only CPU, such as this project's VM since 2026-12-06)."""
    from eagle3.draft_trainer.cpu_bf16 import cpu_bf16_speed

    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    samples = random_samples(8, 97, seed=5)
    features = write_features(samples, tmp_path / "features", model)
    write_vocab(samples, tmp_path / "vocab", 97, 64)
    cfg = {"features": str(features), "vocab": str(tmp_path / "vocab"), "model": str(model), "ttt_steps": 2,
           "max_batch_tokens": 96, "epochs": 1, "progress": False, "device": "cpu"}  # fmt: skip
    with caplog.at_level("WARNING", logger="eagle3.draft_trainer.cpu_bf16"):
        Trainer(load_config(None, {**cfg, "out": str(tmp_path / "fp32")}))
        assert not caplog.records  # fp32: no probe, no word
        trainer = Trainer(load_config(None, {**cfg, "out": str(tmp_path / "bf16"), "autocast_bf16": True}))
    assert trainer.autocast
    warned = [r.getMessage() for r in caplog.records]
    if cpu_bf16_speed().slow:
        assert len(warned) == 1 and "no native bf16" in warned[0] and "autocast_bf16=false" in warned[0], warned
    else:
        assert not warned
