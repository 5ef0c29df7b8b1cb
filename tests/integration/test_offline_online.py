"""Offline metrics predict online speculative decoding: on the same verifier-greedy sequences, the
trainer's scoring of extracted features (the server's hf backend, bf16 as stored) and real speculative
decoding agree per token (step-0 draft right) and per round (position-1 acceptance, τ)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.distill_inprocess import regenerate
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.evaluate import heldout_prompts, load_export_draft
from eagle3.draft_trainer.export import export_draft
from eagle3.draft_trainer.model import NORM_FLAGS
from eagle3.draft_trainer.offline_online import compare_offline_online
from eagle3.draft_trainer.speculate import VerifierTaps
from eagle3.draft_trainer.train import train
from eagle3.draft_trainer.ttt import Teacher, load_verifier_tensors
from eagle3.draft_trainer.vocab import build_draft_vocab, count_assistant_tokens, save_vocab
from eagle3.server.backends.base import BackendConfig
from eagle3.server.backends.hf import HfBackend
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_prepared

pytestmark = pytest.mark.integration

K = 4
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=[False, True], ids=["eagle3", "eagle3.1-norms"])
def trained(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """A tiny random verifier, 64 of its greedy answers as features, a draft trained on them (vocab 80 of 97,
    so some verifier tokens are out of the draft vocab, as with real drafts); also with the three Eagle-3.1
    norms on (training and speculation must feed the post-norm hidden back alike)."""
    norms = dict.fromkeys(NORM_FLAGS, request.param)
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("offon")
    model = tiny_llama_dir(root / "model", hidden_size=64, seed=4)
    prepared = write_prepared(random_samples(200, 97, min_len=6, max_len=14, seed=11), root / "prepared", model, 97)
    distilled = regenerate(
        prepared, root / "distilled", model, max_samples=64, max_new_tokens=NEW_TOKENS, batch_size=32
    )
    features = write_features(distilled, root / "features", model)
    counts = count_assistant_tokens(distilled) + count_assistant_tokens(prepared)
    vocab, stats = build_draft_vocab(counts, 80)
    save_vocab(vocab, stats, counts, root / "vocab")
    cfg = load_config(None, {"features": str(features), "vocab": str(root / "vocab"), "model": str(model),
                             "out": str(root / "run"), "ttt_steps": K, "max_batch_tokens": 512, "epochs": 12,
                             "lr": 3e-3, "progress": False, "heldout_fraction": 0.0, **norms})  # fmt: skip
    train(cfg)
    export = export_draft(root / "run", root / "export")
    return {"model": model, "prepared": prepared, "features": features, "export": export, "norms": request.param}


def test_offline_step0_and_round_walk_match_online_acceptance(trained: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    verifier: Any = AutoModelForCausalLM.from_pretrained(str(trained["model"]), dtype=torch.float32).eval()
    _, tensors = load_verifier_tensors(trained["model"])
    draft = load_export_draft(trained["export"], tensors["embed"])
    assert (draft.cfg.norm_output, draft.cfg.norm_before_fc) == (trained["norms"],) * 2  # the export carried them
    teacher = Teacher(tensors["norm"], tensors["lm_head"], draft.cfg.rms_norm_eps)
    taps = VerifierTaps(verifier, draft.cfg.aux_layer_ids)
    backend = HfBackend(BackendConfig(model=str(trained["model"]), aux_layer_ids=draft.cfg.aux_layer_ids,
                                      dtype="float32", device="cpu"))  # fmt: skip
    backend.load(lambda phase, fraction: None)
    prompts = heldout_prompts(trained["prepared"], trained["features"], 45)  # never trained on
    report = compare_offline_online(verifier, draft, teacher, taps, prompts, k=K, max_new_tokens=NEW_TOKENS,
                                    eos_id=None, extract=lambda ids: backend.extract([ids])[0])  # fmt: skip
    backend.close()
    print(report.format_text())
    assert report.identical
    assert report.online.rounds >= 400  # 3 points is > 2 standard errors of a share over 400 rounds
    # a trained draft, neither hopeless nor perfect, so agreement is not trivial
    assert 0.2 < report.online.accepted_per_position[0] < 0.9
    # the same event, measured offline on the server's features and online by the verifier
    assert abs(report.offline.accepted_per_position[0] - report.online.accepted_per_position[0]) <= 0.03
    assert abs(report.offline_step0 - report.online_step0) <= 0.03
    assert abs(report.offline.tau - report.online.tau) <= 0.05
    assert report.offline.rounds == pytest.approx(report.online.rounds, rel=0.03)
