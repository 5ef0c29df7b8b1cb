"""A micro-batch with no counted term trains on: no supervised row's teacher token is in the draft vocabulary
(what a random DeepSeek-V3 toy with DeepSeek's 129k vocabulary and a 2,048-token draft vocabulary gives), so
its loss is a constant. Before, ``loss.backward()`` raised "element 0 of tensors does not require grad" at
the third step of ``eagle3 train`` on the DeepSeek toy (docs/targets.md, the pipeline run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.train import Trainer
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_vocab

pytestmark = pytest.mark.integration


def test_a_micro_batch_without_counted_terms_takes_no_gradient_and_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    samples = random_samples(8, 97, seed=3)
    features = write_features(samples, tmp_path / "features", model)
    write_vocab(samples, tmp_path / "vocab", 97, 64)
    cfg = load_config(None, {"features": str(features), "vocab": str(tmp_path / "vocab"), "model": str(model),
                             "out": str(tmp_path / "run"), "ttt_steps": 3, "max_batch_tokens": 96, "epochs": 1,
                             "progress": False})  # fmt: skip
    trainer = Trainer(cfg)
    stats = trainer.teacher.draft_vocab_stats

    def nothing_in_vocab(final: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(final), dtype=torch.bool), stats(final, t2d)[1]

    monkeypatch.setattr(trainer.teacher, "draft_vocab_stats", nothing_in_vocab)
    fc = trainer.model.fc.weight.detach().clone()
    trainer.train_step()  # before: RuntimeError: element 0 of tensors does not require grad
    assert torch.equal(trainer.model.fc.weight, fc)  # nothing counted, nothing learnt
