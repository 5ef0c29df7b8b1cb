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
