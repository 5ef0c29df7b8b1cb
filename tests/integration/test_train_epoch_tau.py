"""Simulated τ during training (issue 32 item 4): at the end of every epoch the held-out split is evaluated
(the online round walk replayed, ``heldout_tau``) into a record of its own in metrics.jsonl, the progress bar,
the plot's τ panel and TensorBoard, so a user sees τ move without an eval run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.plot import _W
from eagle3.draft_trainer.train import METRICS_FILE, train
from tests.trainer_helpers import training_files

pytestmark = pytest.mark.integration


def test_every_epoch_logs_the_heldout_tau(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    torch.set_num_threads(1)
    files = training_files(tmp_path / "data", 40, seed=5)
    run = tmp_path / "run"
    cfg = load_config(
        None,
        {
            **files,
            "out": str(run),
            "ttt_steps": 3,
            "max_batch_tokens": 96,
            "epochs": 4,
            "heldout_fraction": 0.25,
            "lr": 3e-3,
            "progress": False,
            "log_to": "tensorboard",
        },
    )
    result = train(cfg)
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    steps_per_epoch = result.steps // 4
    epoch_ends = [r for r in records if r.get("epoch_end")]
    # epochs 0, 1, 2 end inside the run; the 4th ends it and gets the final evaluation instead
    assert [(r["step"], r["epoch"]) for r in epoch_ends] == [(steps_per_epoch * (e + 1), e) for e in range(3)]
    for r in epoch_ends:
        assert 1.0 <= r["heldout_tau"] <= 1.0 + 3 and r["heldout_rounds"] > 0 and "loss" not in r
    final = [r for r in records if r.get("final")]
    assert final and final[-1]["heldout_tau"] == pytest.approx(result.heldout["heldout_tau"])
    assert len({r["heldout_tau"] for r in [*epoch_ends, final[-1]]}) > 1  # it moves as the draft trains

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [e.step for e in events.Scalars("heldout/heldout_tau")]
    assert logged == [r["step"] for r in epoch_ends] + [result.steps]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, result.steps + 1))  # kept apart

    image = Image.open(run / "training.png").convert("RGB")
    assert image.size[0] == 4 * _W  # loss, accuracy, the held-out tau panel and the per-epoch data wait
    tau_panel = image.crop((2 * _W, 0, 3 * _W, image.size[1]))
    colours = tau_panel.getcolors(maxcolors=1 << 16) or []
    assert any(colour == (31, 119, 180) and count > 20 for count, colour in colours)  # the tau polyline is drawn


def test_eval_every_epochs_is_checked() -> None:
    with pytest.raises(ConfigError, match="eval_every_epochs"):
        load_config(None, {"features": "f", "vocab": "v", "out": "o", "eval_every_epochs": -1})
