"""Speculative decoding (chain drafts, greedy verification, KV cache on both) emits exactly the
verifier's greedy output, on many prompts, with a draft trained on the verifier's own outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.distill_inprocess import regenerate
from eagle3.core.protocol.prepared import iter_prepared
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.evaluate import evaluate, heldout_prompts, load_export_draft
from eagle3.draft_trainer.export import check_export, export_draft
from eagle3.draft_trainer.speculate import VerifierTaps, speculative_generate
from eagle3.draft_trainer.train import train
from eagle3.draft_trainer.ttt import load_verifier_tensors
from eagle3.draft_trainer.vocab import build_draft_vocab, count_assistant_tokens, save_vocab
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features, write_prepared

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("spec")
    model = tiny_llama_dir(root / "model", hidden_size=64, seed=4)
    prepared = write_prepared(random_samples(90, 97, min_len=6, max_len=14, seed=7), root / "prepared", model, 97)
    distilled = regenerate(prepared, root / "distilled", model, max_samples=60, max_new_tokens=20, batch_size=30)
    features = write_features(distilled, root / "features", model)
    counts = count_assistant_tokens(distilled) + count_assistant_tokens(prepared)
    vocab, stats = build_draft_vocab(counts, 80)
    save_vocab(vocab, stats, counts, root / "vocab")
    cfg = load_config(None, {"features": str(features), "vocab": str(root / "vocab"), "model": str(model),
                             "out": str(root / "run"), "ttt_steps": 3, "max_batch_tokens": 256, "epochs": 30,
                             "lr": 3e-3, "progress": False, "heldout_fraction": 0.0})  # fmt: skip
    train(cfg)
    export = export_draft(root / "run", root / "export")
    return {"model": model, "prepared": prepared, "distilled": distilled, "features": features, "export": export}


def test_distilled_samples_are_the_verifiers_greedy_answers(trained: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    verifier: Any = AutoModelForCausalLM.from_pretrained(str(trained["model"]), dtype=torch.float32)
    for sample in list(iter_prepared(trained["distilled"]))[:5]:
        start = sample.loss_mask.index(1)
        prompt = torch.tensor([sample.input_ids[:start]])
        want = verifier.generate(prompt, max_new_tokens=sample.n_tokens - start, do_sample=False, pad_token_id=2)
        assert want[0, start:].tolist() == sample.input_ids[start:]


def test_speculative_output_equals_greedy_on_many_prompts(trained: dict[str, Path]) -> None:
    result = evaluate(trained["export"], prepared=trained["prepared"], features=trained["features"],
                      model=str(trained["model"]), k=3, n_prompts=25, max_new_tokens=24,
                      same_sequences=True)  # fmt: skip
    assert result.n_prompts >= 20
    assert result.identical
    assert result.tau > 1.3  # drafts were accepted, so the accept path (cache crops, re-drafting) ran
    assert result.accepted_per_position[0] > 0.2
    assert len(result.offline_acc) == 3
    assert result.offline_rounds > 0 and len(result.offline_accepted_per_position) == 3
    # the same-sequence pass decodes the same prompts again: the same rounds, and offline agrees with them
    same = result.same_sequences
    assert (same["online_rounds"], same["online_tau"]) == (result.rounds, pytest.approx(result.tau))
    assert abs(same["offline_tau"] - same["online_tau"]) < 0.1
    assert "same sequences, offline/online" in result.format_text()


def test_several_ks_in_one_run_equal_one_run_per_k_with_one_baseline_per_prompt(
    trained: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluate_ks`` (``eval -k 3,5,7``, the demo's τ matrix): the same rounds as a run per k, with the
    verifier's greedy baseline decoded once per prompt instead of once per prompt and k."""
    from eagle3.draft_trainer import evaluate as evaluate_module

    kw: dict[str, Any] = {"prepared": trained["prepared"], "model": str(trained["model"]), "n_prompts": 6,
                          "max_new_tokens": 16}  # fmt: skip
    alone = [evaluate(trained["export"], k=k, **kw) for k in (2, 4)]
    calls: list[int] = []
    from eagle3.draft_trainer.speculate import greedy_generate

    def counted(*args: Any) -> Any:
        calls.append(args[2])  # max_new_tokens: the warm-up's 2, a baseline's 16
        return greedy_generate(*args)

    monkeypatch.setattr(evaluate_module, "greedy_generate", counted)
    both = evaluate_module.evaluate_ks(trained["export"], (2, 4), **kw)
    assert [r.k for r in both] == [2, 4]
    for one, many in zip(alone, both, strict=True):
        assert (many.tau, many.rounds, many.generated_tokens, many.identical) == (
            one.tau, one.rounds, one.generated_tokens, True)  # fmt: skip
        assert many.accepted_per_position == one.accepted_per_position
    assert calls == [2] + [16] * 6  # the warm-up, then one baseline per prompt
    assert both[0].baseline_s == both[1].baseline_s


def test_speculative_output_equals_transformers_generate(trained: dict[str, Path]) -> None:
    """An independent reference: transformers' own greedy ``generate`` (no eagle3 code on that side)."""
    from transformers import AutoModelForCausalLM

    check_export(trained["export"])
    verifier: Any = AutoModelForCausalLM.from_pretrained(str(trained["model"]), dtype=torch.float32)
    _, tensors = load_verifier_tensors(trained["model"])
    draft = load_export_draft(trained["export"], tensors["embed"])
    taps = VerifierTaps(verifier, draft.cfg.aux_layer_ids)
    accepted = 0
    for prompt in heldout_prompts(trained["prepared"], trained["features"], 12):
        for k in (1, 4):
            spec = speculative_generate(verifier, draft, taps, prompt, k, 20, eos_id=None)
            want = verifier.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                     pad_token_id=2)[0, len(prompt):]  # fmt: skip
            assert spec.tokens == want.tolist()
            accepted += sum(spec.accepted)
    assert accepted > 0
    assert np.isfinite(accepted)


def test_heldout_split_prompts_come_from_the_features_but_not_from_training(trained: dict[str, Path]) -> None:
    from eagle3.core.features_reader import FeaturesReader
    from eagle3.core.protocol.prepared import is_heldout
    from eagle3.draft_trainer.errors import DataError

    fraction = 0.3
    held: set[tuple[int, ...]] = set()
    train_split: set[tuple[int, ...]] = set()
    for sample in FeaturesReader(trained["features"]):
        prompt = tuple(sample.input_ids[: sample.loss_mask.tolist().index(1)].tolist())
        (held if is_heldout(sample.sample_id, fraction) else train_split).add(prompt)
    want = held - train_split
    assert want, "the fixture's split should hold some prompts out"
    got = heldout_prompts(trained["prepared"], trained["features"], 1000, heldout_fraction=fraction)
    assert {tuple(p) for p in got} == want
    unseen = heldout_prompts(trained["prepared"], trained["features"], 1000)
    assert not {tuple(p) for p in unseen} & (held | train_split)
    with pytest.raises(DataError, match="--features"):
        heldout_prompts(trained["prepared"], None, 5, heldout_fraction=fraction)
