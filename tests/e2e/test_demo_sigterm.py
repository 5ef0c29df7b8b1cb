"""``eagle3 demo`` stopped by SIGTERM while it trains (a job scheduler's preemption): the trainer saves its
checkpoint, and the demo ends with status 143 and "rerun ... to resume" before export and eval, so a partial
draft is never exported or reported as the demo's τ. The rerun is not timed here: resume itself is
``tests/integration/test_train_resume.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.demo import EXIT_STOPPED
from eagle3.draft_trainer.checkpoint import CHECKPOINT_FILE
from eagle3.draft_trainer.train import METRICS_FILE

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def _logged_steps(run: Path) -> int:
    path = run / METRICS_FILE
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}") and "loss" in json.loads(line))


def test_sigterm_during_training_saves_and_stops_before_export(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "eagle3", "demo", "--out", str(out), "--samples", "12", "--epochs", "1000",
           "--eval-prompts", "1"]  # fmt: skip  # 1000 epochs: still training when the signal comes
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = out / "run"
    deadline = time.monotonic() + 600
    try:
        # the handler is installed before the first step, so a logged step means SIGTERM reaches it
        while _logged_steps(run) < 3:
            assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()[-3000:]
            assert time.monotonic() < deadline, "the demo did not reach its third training step in 600 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = stdout.decode()
    assert proc.returncode == EXIT_STOPPED == 143, text[-3000:]
    assert "stopped by SIGTERM" in text and "Rerun the same command to resume" in text
    checkpoint_step = torch.load(run / CHECKPOINT_FILE, weights_only=True)["step"]
    assert checkpoint_step >= 3 and f"at step {checkpoint_step}:" in text  # saved at the stop, not step 0
    assert "[7/8]" not in text and not (out / "export").exists()  # no export of the partial draft
    assert "[8/8]" not in text and "tau" not in text.split("stopped by SIGTERM", 1)[1]
