"""``dropout``: residual dropout on the draft layer while training only. A training step with it differs
from one without (the same seed, the same batch); the held-out pass, speculation and the export see the
undropped draft; the draft's weights and exported tensors are the same set; bad values are refused.
Exact resume with dropout on is tests/integration/test_train_resume.py (its fixture trains with it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.train import Trainer
from tests.trainer_helpers import training_files

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    files = training_files(tmp_path_factory.mktemp("dropout"), 24, seed=4)
    return {**files, "ttt_steps": 3, "max_batch_tokens": 96, "epochs": 2, "lr": 1e-2, "warmup_steps": 1,
            "progress": False}  # fmt: skip


def _trainer(settings: dict[str, object], out: Path, dropout: float) -> Trainer:
    torch.manual_seed(0)
    return Trainer(load_config(None, dict(settings, out=str(out), dropout=dropout)))


def test_dropout_changes_training_steps_but_not_the_heldout_pass(settings: dict[str, object], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    plain, dropped = _trainer(settings, tmp_path / "plain", 0.0), _trainer(settings, tmp_path / "dropped", 0.3)
    for name, weight in plain.model.state_dict().items():  # the same initial draft, the same exported tensors
        assert torch.equal(weight, dropped.model.state_dict()[name]), name
    assert dropped.model.resid_dropout.p == 0.3 and dropped.model.training

    before = plain.evaluate_heldout(), dropped.evaluate_heldout()
    assert before[0] == before[1], "the held-out pass must not drop anything"
    assert dropped.model.training, "evaluate_heldout puts the model back in training mode"
    assert dropped.evaluate_heldout() == before[1], "and the pass is deterministic"

    first = plain.train_step(), dropped.train_step()
    # at initialisation (weights of std 0.02) the layer's outputs are small beside the residual: a small change
    assert first[0]["loss"] != first[1]["loss"], "dropout must change the training loss"
    fc_plain, fc_dropped = plain.model.fc.weight, dropped.model.fc.weight
    assert not torch.allclose(fc_plain, fc_dropped), "and so the update"

    again = _trainer(settings, tmp_path / "again", 0.3)  # the same seed: the same masks, the same step
    assert again.train_step()["loss"] == first[1]["loss"]


def test_eval_mode_draft_with_dropout_set_equals_the_plain_draft(settings: dict[str, object], tmp_path: Path) -> None:
    trainer = _trainer(settings, tmp_path / "run", 0.5)
    draft = trainer.model
    hidden_size = draft.cfg.hidden_size
    n_heads_dim = draft.midlayer.self_attn.n_heads * draft.midlayer.self_attn.head_dim
    attn_out, residual = torch.randn(7, n_heads_dim), torch.randn(7, hidden_size)
    with torch.no_grad():
        draft.eval()
        evaluated = draft.finish(attn_out, residual)
        draft.resid_dropout.p = 0.0
        plain = draft.finish(attn_out, residual)
        draft.train()
        assert torch.equal(draft.finish(attn_out, residual), plain), "p = 0 in training mode drops nothing"
        draft.resid_dropout.p = 0.5
        trained = draft.finish(attn_out, residual)
    assert torch.equal(evaluated, plain)
    assert not torch.allclose(trained, plain)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_dropout_outside_zero_to_one_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match=r"dropout must be in \[0, 1\)"):
        load_config(None, {"dropout": value})
