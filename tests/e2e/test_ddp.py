"""Data parallel: ``torchrun`` with 2 CPU processes (gloo) equals 1 process with the same global batch
(``grad_accum_steps=2``): same loss curve and same final weights, to float tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.train import METRICS_FILE, train
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_vocab

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def _curve(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / METRICS_FILE).read_text().splitlines()) if "loss" in r]


def test_two_gloo_processes_equal_one_with_the_same_global_batch(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    samples = random_samples(40, 97, seed=9)
    features = write_features(samples, tmp_path / "features", model)
    write_vocab(samples, tmp_path / "vocab", 97, 64)
    common = {"ttt_steps": "3", "max_batch_tokens": "64", "epochs": "3", "progress": "false", "lr": "3e-3",
              "warmup_steps": "2", "heldout_fraction": "0.1"}  # fmt: skip

    paths = {"features": str(features), "vocab": str(tmp_path / "vocab"), "model": str(model)}
    single = train(load_config(None, dict(common, **paths, out=str(tmp_path / "single"), grad_accum_steps="2")))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
            "-m", "eagle3.train", "--features", str(features), "--vocab", str(tmp_path / "vocab"),
            "--model", str(model), "--out", str(tmp_path / "ddp")]  # fmt: skip
    for key, value in common.items():
        args += ["--set", f"{key}={value}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    one, two = _curve(tmp_path / "single"), _curve(tmp_path / "ddp")
    assert len(one) == len(two) == single.steps > 5
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    w1 = load_file(str(tmp_path / "single" / "draft" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "ddp" / "draft" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5)
    held = json.loads((tmp_path / "ddp" / "heldout.json").read_text())
    assert held["heldout_acc"] == pytest.approx(single.heldout["heldout_acc"], abs=1e-5)
