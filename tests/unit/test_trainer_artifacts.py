"""Artifacts other programs read (issue 30 item 10): an export another user's vLLM can read, a checkpoint
loaded without unpickling code, and SpecForge's vocab_mapping.pt beside a SpecForge conversion."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.draft_trainer.build import lr_lambda
from eagle3.draft_trainer.checkpoint import CHECKPOINT_FILE, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from eagle3.draft_trainer.errors import CheckpointError
from eagle3.draft_trainer.export import EXPORT_CONFIG, EXPORT_WEIGHTS, export_draft
from eagle3.draft_trainer.interop import VOCAB_MAPPING, to_specforge
from eagle3.draft_trainer.model import DraftConfig, EagleDraft
from eagle3.draft_trainer.vocab import build_draft_vocab, save_vocab
from tests.unit.test_interop_specforge import features, verifier

CFG = DraftConfig(
    hidden_size=32,
    target_hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    draft_vocab_size=40,
    target_vocab_size=100,
    aux_layer_ids=(1, 2, 3),
)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_files_are_readable_as_the_umask_allows(tmp_path: Path, umask: int, mode: int, fmt: str) -> None:
    from eagle3.draft_trainer.checkpoint import save_draft

    save_draft(EagleDraft(CFG), tmp_path / "run" / "draft")
    model, _ = verifier(tmp_path / "verifier")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    old = os.umask(umask)
    try:
        out = export_draft(tmp_path / "run", tmp_path / "export", format=fmt, verifier=str(model))
    finally:
        os.umask(old)
    for name in (EXPORT_WEIGHTS, EXPORT_CONFIG):
        assert stat.S_IMODE((out / name).stat().st_mode) == mode, name


def _trainer_like_state() -> dict[str, object]:
    """What ``Trainer.state`` saves: model, AdamW after a step, the LambdaLR, step, RNG states, config."""
    model = EagleDraft(CFG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.fc.weight.sum().backward()
    optimizer.step()

    class Cfg:
        warmup_steps, min_lr_ratio = 2, 0.1

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(Cfg(), 10))  # type: ignore[arg-type]
    scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": 1,
        "rng": rng_state(),
        "config": {"lr": 1e-3, "log_to": None, "aux": [1, 2]},
    }


def test_checkpoint_holds_only_tensors_and_plain_types_and_resumes_the_rngs(tmp_path: Path) -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    state = _trainer_like_state()
    path = save_checkpoint(tmp_path, state)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    torch.load(path, weights_only=True)  # no allowlist needed
    want = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random())

    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 1
    set_rng_state(loaded["rng"])
    got = (torch.rand(3), np.random.standard_normal(3), np.random.rand(2), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])
    assert got[3] == want[3]
    for name, tensor in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(loaded["model"][name], tensor), name


def test_a_pickled_checkpoint_is_refused_with_what_to_do(tmp_path: Path) -> None:
    torch.save({"rng": {"numpy": np.random.get_state()}, "step": 3}, tmp_path / CHECKPOINT_FILE)  # the old format
    with pytest.raises(CheckpointError, match=r"numpy.*delete the file to train from step 0"):
        load_checkpoint(tmp_path)


def test_specforge_conversion_writes_its_vocab_mapping(tmp_path: Path) -> None:
    model, _ = verifier(tmp_path / "verifier")
    features(tmp_path / "features", n_samples=3)
    counts = np.random.default_rng(0).integers(0, 50, size=100)
    vocab, stats = build_draft_vocab(counts, 40)
    save_vocab(vocab, stats, counts, tmp_path / "vocab")
    to_specforge(tmp_path / "features", tmp_path / "sf", model, tmp_path / "vocab")
    mapping = torch.load(tmp_path / "sf" / VOCAB_MAPPING, weights_only=True)
    # SpecForge's load_vocab_mapping copies these into its draft's d2t / t2d buffers
    assert set(mapping) == {"d2t", "t2d"}
    assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
    assert torch.equal(mapping["d2t"], torch.from_numpy(vocab.d2t).long())
    target_ids = torch.arange(40) + mapping["d2t"]  # SpecForge's convention: target = draft + d2t
    assert torch.equal(mapping["t2d"].nonzero().squeeze(1), target_ids)
    assert torch.equal(target_ids, torch.from_numpy(vocab.target_ids).long())
    to_specforge(tmp_path / "features", tmp_path / "sf2", model)  # no vocab given: none written
    assert not (tmp_path / "sf2" / VOCAB_MAPPING).exists()
