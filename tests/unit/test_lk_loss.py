"""The LK objectives (draft_trainer/ttt_loss.py; arXiv:2602.23881 as SpecForge PR #492 defines them): values
against a hand computation, gradients (float64 gradcheck, and the stop-gradient of lk_lambda's weight), the
chunked/checkpointed loss equal to one chunk, bf16 autocast, the optimum where the definition puts it, the
config/CLI knob, and an exact resume of an LK run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from eagle3.draft_trainer import config as train_config
from eagle3.draft_trainer import ttt_loss
from eagle3.draft_trainer.checkpoint import save_checkpoint
from eagle3.draft_trainer.errors import ConfigError
from eagle3.draft_trainer.model import EagleDraft
from eagle3.draft_trainer.ttt import ttt_forward
from eagle3.draft_trainer.ttt_loss import Objective, chunk_terms
from tests.unit.test_draft_ttt import _batch, _draft


class _Head(torch.nn.Module):
    """A stand-in draft whose logits are its input: the tests choose the draft's logits directly."""

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return prenorm


def _terms(
    logits: torch.Tensor, teacher_p: torch.Tensor, objective: Objective
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[m, Vd] draft logits and [m, Vd] verifier probabilities of the draft-vocab tokens (rows may sum to
    less than 1: the mass outside the draft vocab) -> chunk_terms' CE, acceptance, hits."""
    mass = teacher_p.sum(-1)
    logp = (teacher_p / mass[:, None]).log()  # renormalised over the draft vocab, as the trainer's teacher
    rows = torch.arange(logits.shape[0])
    arg = logp.argmax(-1)
    draft = cast(EagleDraft, _Head())
    return chunk_terms(draft, logits, rows, rows, logp, arg, mass.log(), objective)


def test_values_equal_a_hand_computation() -> None:
    """q = (0.5, 0.25, 0.25); the verifier puts (0.4, 0.4, 0.1) on the draft vocab and 0.1 outside it.
    alpha = min(.4,.5) + min(.4,.25) + min(.1,.25) = 0.75 (the 0.1 outside is never accepted);
    CE = -sum (p/0.9) log q; lk_alpha = -log 0.75; lk_lambda = w CE + (1 - w)(1 - 0.75), w = exp(-3 * 0.75)
    (the defaults kl_scale 1, kl_decay 3)."""
    q = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    p = torch.tensor([[0.4, 0.4, 0.1]], dtype=torch.float64)
    ce_hand = -(0.4 / 0.9 * math.log(0.5) + 0.4 / 0.9 * math.log(0.25) + 0.1 / 0.9 * math.log(0.25))
    ce, accept, hit = _terms(q.log(), p, Objective("kl"))
    assert float(accept) == pytest.approx(0.75, abs=1e-12)  # <= 0.9, the mass the draft vocab can take
    assert float(ce) == pytest.approx(ce_hand, abs=1e-12)
    assert bool(hit)  # both argmax at token 0
    assert float(Objective("kl").step_sum(ce, accept)) == pytest.approx(ce_hand, abs=1e-12)
    assert float(Objective("lk_alpha").step_sum(ce, accept)) == pytest.approx(-math.log(0.75), abs=1e-12)
    w = math.exp(-3 * 0.75)
    lam = Objective("lk_lambda").step_sum(ce, accept)
    assert float(lam) == pytest.approx(w * ce_hand + (1 - w) * 0.25, abs=1e-12)
    w2 = 0.5 * math.exp(-3 * 0.75)  # kl_scale 0.5, kl_decay 3
    lam2 = Objective("lk_lambda", kl_scale=0.5, kl_decay=3.0).step_sum(ce, accept)
    assert float(lam2) == pytest.approx(w2 * ce_hand + (1 - w2) * 0.25, abs=1e-12)


def test_lambda_weight_is_the_mean_acceptance_of_the_step() -> None:
    """Two rows, alphas 0.75 and 0.25: w = exp(-3 mean alpha) = exp(-1.5) weights both rows' CE."""
    ce = torch.tensor([2.0, 3.0], dtype=torch.float64)
    accept = torch.tensor([0.75, 0.25], dtype=torch.float64)
    w = math.exp(-1.5)
    got = Objective("lk_lambda").step_sum(ce, accept)
    assert float(got) == pytest.approx(w * 5.0 + (1 - w) * (0.25 + 0.75), abs=1e-12)


@pytest.mark.parametrize("chunked", [False, True])
def test_gradients_by_gradcheck_in_float64(monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    """CE, alpha and lk_alpha against finite differences (float64), as one chunk and as checkpointed chunks of
    2 rows. lk_lambda's weight is a stop-gradient (the reference detaches it): its gradient is
    w grad(CE) - (1 - w) grad(alpha) with w fixed, which finite differences of the whole would not give."""
    if chunked:
        monkeypatch.setattr(ttt_loss, "KEEP_LOSS_ELEMENTS", 0)
        monkeypatch.setattr(ttt_loss, "LOSS_CHUNK_ELEMENTS", 2 * 6)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(5, 6, dtype=torch.float64, generator=g), -1) * 0.8  # 20 % outside the vocab

    def parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ce, accept, _ = _terms(x, p, Objective("lk_alpha"))
        return ce, accept, Objective("lk_alpha").step_sum(ce, accept)

    assert torch.autograd.gradcheck(parts, (logits,), eps=1e-6, atol=1e-7)

    ce, accept, _ = _terms(logits, p, Objective("lk_lambda"))
    w = math.exp(-3 * float(accept.detach().mean()))
    (got,) = torch.autograd.grad(Objective("lk_lambda").step_sum(ce, accept), logits)
    ce, accept, _ = _terms(logits, p, Objective("lk_lambda"))
    (want,) = torch.autograd.grad(w * ce.sum() - (1 - w) * accept.sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_kl_leaves_acceptance_a_metric_without_gradient() -> None:
    logits = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(4, 5, dtype=torch.float64), -1)
    ce, accept, _ = _terms(logits, p, Objective("kl"))
    assert ce.requires_grad and not accept.requires_grad
    assert float(Objective("kl").step_sum(ce, accept)) == float(ce.sum())


@pytest.mark.parametrize("name", ["lk_lambda", "lk_alpha"])
def test_chunked_equals_unchunked_through_the_ttt_steps(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The full TTT forward (4 steps, step_decay weights, three packed samples) with one loss chunk per step and
    with checkpointed chunks of 3 rows: the same loss, acceptance and gradients."""
    draft, teacher = _draft()
    batch = _batch([11, 1, 17, 9], seed=5)
    params = [p for p in draft.parameters() if p.requires_grad]
    objective = Objective(name)
    whole = ttt_forward(draft, teacher, batch, 4, attention="blockwise", objective=objective)
    whole_grads = torch.autograd.grad(whole.loss, params)
    monkeypatch.setattr(ttt_loss, "KEEP_LOSS_ELEMENTS", 0)
    monkeypatch.setattr(ttt_loss, "LOSS_CHUNK_ELEMENTS", 3 * 40)
    chunked = ttt_forward(draft, teacher, batch, 4, attention="blockwise", objective=objective)
    grads = torch.autograd.grad(chunked.loss, params)
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked.accept_sums, whole.accept_sums, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    kl = ttt_forward(draft, teacher, batch, 4, attention="blockwise")
    assert float((whole.loss - kl.loss).abs()) > 1e-3  # the objective is not the KL one
    torch.testing.assert_close(kl.accept_sums, whole.accept_sums)  # the same alpha metric either way


def test_teacher_mass_outside_the_draft_vocab_caps_the_acceptance() -> None:
    """The trainer's teacher: alpha uses the verifier's full-vocab probabilities of the draft vocab (V 50, Vd 40),
    so a row's alpha never exceeds that row's draft-vocab mass, and the cached stats give the same result."""
    draft, teacher = _draft()
    batch = _batch([20], seed=1)
    result = ttt_forward(draft, teacher, batch, 1, objective=Objective("lk_alpha"))
    in_vocab, log_mass = teacher.draft_vocab_stats(batch.final, draft.t2d)
    full = torch.softmax(teacher(batch.final), -1)  # [T, V]
    torch.testing.assert_close(log_mass.exp(), full[:, draft.t2d].sum(-1))
    assert float(log_mass.exp().max()) < 1 and float(log_mass.exp().mean()) < 0.95  # 10 of the 50 ids outside
    cached = ttt_forward(
        draft, teacher, batch, 1, teacher_in_vocab=in_vocab, teacher_log_mass=log_mass, objective=Objective("lk_alpha")
    )
    torch.testing.assert_close(cached.loss, result.loss)
    assert 0 < float(result.accept_sums[0]) < float(result.n_terms[0])


def test_bf16_autocast_gives_the_fp32_loss_within_bf16_error() -> None:
    draft, teacher = _draft()
    batch = _batch([30, 12], seed=2)
    params = [p for p in draft.parameters() if p.requires_grad]
    for name in ("lk_lambda", "lk_alpha"):
        fp32 = ttt_forward(draft, teacher, batch, 4, objective=Objective(name))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = ttt_forward(draft, teacher, batch, 4, objective=Objective(name))
        grads = torch.autograd.grad(bf16.loss, params, allow_unused=True)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        assert abs(float(bf16.loss) - float(fp32.loss)) <= 0.03 * abs(float(fp32.loss))


@pytest.mark.parametrize("name", ["lk_lambda", "lk_alpha"])
def test_optimum_is_where_the_definition_puts_it(name: str) -> None:
    """Free draft logits trained on the objective alone: with the whole mass in the draft vocab, alpha -> 1 and
    q -> p (1 - TV = 1 iff q = p); the value at q = p (lk_alpha: 0) is below every perturbation's (TV has a
    kink there: a subgradient, not a zero gradient). With 10 % of the mass outside, alpha -> 0.9, its cap,
    and q covers p pointwise."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(3, 8, dtype=torch.float64, generator=g), -1)
    for mass in (1.0, 0.9):
        logits = torch.zeros(3, 8, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.Adam([logits], lr=0.1)
        for _ in range(1500):
            optimizer.zero_grad()
            ce, accept, _ = _terms(logits, p * mass, Objective(name))
            Objective(name).step_sum(ce, accept).backward()
            optimizer.step()
        q = torch.softmax(logits.detach(), -1)
        accept = torch.minimum(q, p * mass).sum(-1)
        assert float(accept.min()) > mass - 0.01
        assert float((p * mass - q).max()) < 0.01  # q >= p (the draft-vocab part) up to 1 %
        if mass == 1.0:
            assert float((q - p).abs().max()) < 0.01
    with torch.no_grad():
        value = float(Objective(name).step_sum(*_terms(p.log(), p, Objective(name))[:2]))
        if name == "lk_alpha":
            assert value == pytest.approx(0.0, abs=1e-12)
        for scale in (1e-3, 1e-2, 0.1, 1.0):
            for _ in range(25):
                off = p.log() + scale * torch.randn(3, 8, dtype=torch.float64, generator=g)
                assert float(Objective(name).step_sum(*_terms(off, p, Objective(name))[:2])) > value


def test_the_knob_in_config_cli_and_loss_module_agree() -> None:
    from eagle3.draft_trainer import cli

    assert cli.LOSSES == train_config.LOSSES == ttt_loss.OBJECTIVES
    assert train_config.load_config(None, {"loss": "lk_alpha"}).loss == "lk_alpha"
    assert train_config.TrainConfig().loss == "kl"  # KL stays the default (docs/training.md, "Objective")
    with pytest.raises(ConfigError, match="loss must be one of kl, lk_lambda, lk_alpha, got 'tv'"):
        train_config.load_config(None, {"loss": "tv"})
    with pytest.raises(ConfigError, match="lk_kl_scale and lk_kl_decay must be >= 0"):
        train_config.load_config(None, {"lk_kl_decay": "-1"})


def test_an_lk_run_resumes_to_the_same_losses(tmp_path: Path) -> None:
    """Checkpoint after 3 steps, a new trainer resumes from it: steps 4-6 give the uninterrupted run's losses
    (lk_lambda's weight depends on the batch only, nothing to carry); the saved config keeps the objective."""
    from eagle3.draft_trainer.train import Trainer
    from tests.trainer_helpers import training_files

    torch.set_num_threads(1)
    files = training_files(tmp_path / "data", 24, seed=1)
    settings: dict[str, Any] = dict(
        files,
        ttt_steps="3",
        max_batch_tokens="96",
        epochs="3",
        progress="false",
        loss="lk_lambda",
        heldout_fraction="0.3",
    )
    straight = Trainer(train_config.load_config(None, dict(settings, out=str(tmp_path / "a"))))
    want = [straight.train_step()["loss"] for _ in range(6)]
    cfg = train_config.load_config(None, dict(settings, out=str(tmp_path / "b")))
    first = Trainer(cfg)
    got = [first.train_step()["loss"] for _ in range(3)]
    first.run_dir.mkdir(parents=True)
    save_checkpoint(first.run_dir, first.state())
    second = Trainer(cfg)
    assert second.resume() and second.step == 3
    got += [second.train_step()["loss"] for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-6)
    held = second.evaluate_heldout()  # the held-out evaluation reports the expected acceptance too
    assert len(held["heldout_alpha"]) == 3 and all(0 < a < 1 for a in held["heldout_alpha"])
    saved = tmp_path / "b" / "config.json"
    saved.write_text(cfg.to_json())
    assert train_config.load_config(saved).loss == "lk_lambda"
