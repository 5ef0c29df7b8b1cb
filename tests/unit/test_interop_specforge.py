"""eagle3 features <-> SpecForge offline hidden states: the SpecForge layout as its trainer reads it,
the final state normalised with the verifier's own norm, and a round trip that is bitwise exact
(SpecForge -> eagle3 -> SpecForge), with the post-norm import refused by eagle3 train."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.interop import from_specforge, rms_norm, to_specforge

HIDDEN, AUX, FINAL, EPS = 32, (2, 4, 5), 8, 1e-5
META = FeaturesMeta("tiny", "r" * 8, AUX, FINAL, HIDDEN, 100, "bfloat16", "t" * 64)


def verifier(root: Path) -> tuple[Path, torch.Tensor]:
    """A checkpoint directory holding what the converter reads: config, embed, norm, lm_head."""
    root.mkdir()
    norm = torch.rand(HIDDEN) + 0.5
    (root / "config.json").write_text(f'{{"hidden_size": {HIDDEN}, "vocab_size": 100, "rms_norm_eps": {EPS}, '
                                      '"tie_word_embeddings": false}')  # fmt: skip
    save_file({"model.embed_tokens.weight": torch.randn(100, HIDDEN), "model.norm.weight": norm,
               "lm_head.weight": torch.randn(100, HIDDEN)}, str(root / "model.safetensors"))  # fmt: skip
    return root, norm


def features(root: Path, n_samples: int = 7) -> list[ExtractedSample]:
    rng = np.random.default_rng(0)
    samples = []
    writer = FeaturesWriter.open(root, META, shard_mb=0.01)  # several shards
    for i in range(n_samples):
        n = int(rng.integers(1, 40))
        bits = torch.randn(n, len(AUX) + 1, HIDDEN).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        sample = ExtractedSample(f"s{i}", rng.integers(0, 100, n).astype(np.int32),
                                 rng.integers(0, 2, n).astype(np.uint8), bits, AUX, FINAL)  # fmt: skip
        writer.add(sample)
        samples.append(sample)
    writer.close()
    return samples


def test_round_trip_is_bitwise_and_the_layout_is_specforges(tmp_path: Path) -> None:
    model, norm = verifier(tmp_path / "verifier")
    samples = features(tmp_path / "features")
    assert to_specforge(tmp_path / "features", tmp_path / "sf", model) == len(samples)

    for index, sample in enumerate(samples):
        data = torch.load(tmp_path / "sf" / "rows_0-5000" / f"data_{index}.ckpt", weights_only=True)
        n = sample.n_tokens
        assert set(data) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["input_ids"].tolist() == sample.input_ids.tolist()
        assert data["loss_mask"].tolist() == sample.loss_mask.tolist()
        assert data["aux_hidden_state"].shape == (1, n, 3 * HIDDEN) and data["hidden_state"].shape == (1, n, HIDDEN)
        states = sample.as_torch()
        for k in range(3):  # concatenated in aux_layer_ids order, bit for bit
            assert torch.equal(data["aux_hidden_state"][0, :, k * HIDDEN : (k + 1) * HIDDEN].view(torch.int16),
                               states[:, k].view(torch.int16))  # fmt: skip
        normed = states[:, -1].float() / (states[:, -1].float().pow(2).mean(-1, keepdim=True) + EPS).sqrt() * norm
        torch.testing.assert_close(data["hidden_state"][0].float(), normed, rtol=1e-2, atol=1e-2)  # bf16 rounding
        assert torch.equal(data["hidden_state"][0], rms_norm(states[:, -1], norm, EPS).to(torch.bfloat16))

    assert from_specforge(tmp_path / "sf", tmp_path / "back") == len(samples)
    back = FeaturesReader(tmp_path / "back", verify=True)
    assert back.meta.final_norm_applied and back.meta.aux_layer_ids == AUX and back.meta.model_id == "tiny"
    assert sorted(back.sample_ids) == sorted(s.sample_id for s in samples)
    for sample in samples:
        got = back[sample.sample_id]
        assert np.array_equal(got.input_ids, sample.input_ids) and np.array_equal(got.loss_mask, sample.loss_mask)
        assert np.array_equal(got.hidden_states_bf16[:, :-1], sample.hidden_states_bf16[:, :-1])  # aux: bitwise

    with pytest.raises(DataError, match="post-norm"):
        FeaturesData(tmp_path / "back")  # eagle3 train would normalise twice
    # SpecForge -> eagle3 -> SpecForge: the same files, every tensor bitwise equal
    assert to_specforge(tmp_path / "back", tmp_path / "sf2") == len(samples)  # post-norm: no norm needed
    for path in (tmp_path / "sf").rglob("*.ckpt"):
        first = torch.load(path, weights_only=True)
        second = torch.load(tmp_path / "sf2" / path.relative_to(tmp_path / "sf"), weights_only=True)
        assert first.keys() == second.keys()
        for key in first:
            a, b = first[key], second[key]
            assert a.dtype == b.dtype and a.shape == b.shape, (path.name, key)
            assert torch.equal(a.view(torch.int16) if a.is_floating_point() else a,
                               b.view(torch.int16) if b.is_floating_point() else b), (path.name, key)  # fmt: skip
    with pytest.raises(DataError, match="--model"):
        to_specforge(tmp_path / "features", tmp_path / "sf3")  # pre-norm needs the verifier's norm


def test_a_specforge_directory_without_identity_needs_one(tmp_path: Path) -> None:
    (tmp_path / "sf" / "rows_0-5000").mkdir(parents=True)
    torch.save({"input_ids": torch.arange(3), "loss_mask": torch.ones(3, dtype=torch.int64),
                "hidden_state": torch.zeros(1, 3, HIDDEN, dtype=torch.bfloat16),
                "aux_hidden_state": torch.zeros(1, 3, 3 * HIDDEN, dtype=torch.bfloat16)},
               tmp_path / "sf" / "rows_0-5000" / "data_0.ckpt")  # fmt: skip
    with pytest.raises(DataError, match="eagle3_features.json"):
        from_specforge(tmp_path / "sf", tmp_path / "out")
    assert from_specforge(tmp_path / "sf", tmp_path / "out", META) == 1
    assert FeaturesReader(tmp_path / "out").sample_ids == ["data_0"]


def test_convert_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    model, _ = verifier(tmp_path / "verifier")
    samples = features(tmp_path / "features", n_samples=3)
    assert main(["convert", str(tmp_path / "features"), "--out", str(tmp_path / "sf"), "--to", "specforge"]) == 1
    assert "--model" in capsys.readouterr().err  # a one-line error naming the fix
    args = ["convert", str(tmp_path / "features"), "--out", str(tmp_path / "sf"), "--to", "specforge"]
    assert main([*args, "--model", str(model)]) == 0
    assert main(["convert", str(tmp_path / "sf"), "--out", str(tmp_path / "back"), "--to", "eagle3"]) == 0
    assert len(FeaturesReader(tmp_path / "back")) == len(samples)
