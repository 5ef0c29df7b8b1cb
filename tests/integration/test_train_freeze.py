"""``freeze_lm_head``: the draft's lm_head keeps the verifier's rows of the draft vocabulary and its final norm
the verifier's weights through training, while every other weight trains; without the verifier's rows to
keep, the setting is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.train import Trainer
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_vocab

pytestmark = pytest.mark.integration


def test_frozen_head_and_norm_stay_the_verifiers_while_the_rest_trains(tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    samples = random_samples(16, 97, seed=3)
    features = write_features(samples, tmp_path / "features", model)
    vocab = write_vocab(samples, tmp_path / "vocab", 97, 64)
    cfg = load_config(None, {"features": str(features), "vocab": str(tmp_path / "vocab"), "model": str(model),
                             "out": str(tmp_path / "run"), "ttt_steps": 3, "max_batch_tokens": 96, "epochs": 5,
                             "lr": 1e-2, "warmup_steps": 1, "progress": False, "freeze_lm_head": True})  # fmt: skip
    trainer = Trainer(cfg)
    head = trainer.model.lm_head.weight.detach().clone()
    norm = trainer.model.norm.weight.detach().clone()
    fc = trainer.model.fc.weight.detach().clone()
    teacher_rows = trainer.teacher.lm_head_weight[torch.from_numpy(vocab.target_ids)]
    assert torch.equal(head, teacher_rows.to(head.dtype))
    for _ in range(3):
        trainer.train_step()
    assert torch.equal(trainer.model.lm_head.weight, head) and torch.equal(trainer.model.norm.weight, norm)
    assert not torch.equal(trainer.model.fc.weight, fc), "the rest of the draft must train"
    assert all(p.requires_grad for p in trainer.params) and len(trainer.params) == sum(
        1 for name, p in trainer.model.named_parameters() if not name.startswith(("lm_head", "norm"))
    )


def test_freezing_a_head_that_is_not_the_verifiers_is_refused() -> None:
    with pytest.raises(ConfigError, match="init_lm_head_from_verifier"):
        load_config(None, {"freeze_lm_head": True, "init_lm_head_from_verifier": False})
