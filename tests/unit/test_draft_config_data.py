"""Config (file + overrides, errors naming the key) and data (split, token-budget plans, packing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from eagle3.cli import main
from eagle3.core.protocol.prepared import is_heldout, variant_id, variant_of
from eagle3.draft_trainer.config import TrainConfig, load_config, parse_overrides
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.errors import ConfigError, DataError
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features


def test_config_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text('lr = 0.01\nttt_steps = 3\nfeatures = "f"\n')
    cfg = load_config(path, {"ttt_steps": "5", "autocast_bf16": "true"})
    assert (cfg.lr, cfg.ttt_steps, cfg.features, cfg.autocast_bf16) == (0.01, 5, "f", True)
    saved = tmp_path / "config.json"
    saved.write_text(cfg.to_json())
    assert load_config(saved) == cfg  # the resolved config a run saves loads back unchanged


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'learning_rate'"):
        load_config(None, {"learning_rate": "1"})
    with pytest.raises(ConfigError, match="ttt_steps expects int"):
        load_config(None, {"ttt_steps": "seven"})
    bad = tmp_path / "c.json"
    bad.write_text('{"max_batch_tokens": 0}')
    with pytest.raises(ConfigError, match="max_batch_tokens must be >= 1"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["lr"])
    assert TrainConfig().ttt_steps == 7


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("feat")
    model = tiny_llama_dir(root / "model", hidden_size=32)
    return write_features(random_samples(30, 97, min_len=5, max_len=40, seed=1), root / "features", model)


def test_split_and_plans(features: Path) -> None:
    data = FeaturesData(features, heldout_fraction=0.2)
    train, held = data.split.train, data.split.heldout
    assert set(train).isdisjoint(held) and len(train) + len(held) == 30 and held
    assert FeaturesData(features, heldout_fraction=0.2).split == data.split  # a pure function of the ids
    plan = data.plan(train, 64, seed=0, epoch=0)
    assert sorted(p for b in plan for p in b) == sorted(train)  # every sample once per epoch
    assert all(sum(int(data.n_tokens[p]) for p in b) <= 64 for b in plan)
    assert plan == data.plan(train, 64, seed=0, epoch=0)
    assert plan != data.plan(train, 64, seed=0, epoch=1)


def test_plans_do_not_depend_on_the_manifest_order(tmp_path: Path) -> None:
    """Two extractions of the same samples in another arrival order (manifest order) give the same split
    and the same batches of the same samples: the canonical order (sorted ids) a stream from the servers
    plans over too (``eagle3 train --server``, docs/training.md)."""
    samples = random_samples(24, 97, min_len=5, max_len=30, seed=4)
    model = tiny_llama_dir(tmp_path / "model", hidden_size=32)
    forward = FeaturesData(write_features(samples, tmp_path / "forward", model), heldout_fraction=0.2)
    backward = FeaturesData(write_features(samples[::-1], tmp_path / "backward", model), heldout_fraction=0.2)
    assert forward.reader.sample_ids != backward.reader.sample_ids  # the manifests differ
    for data in (forward, backward):
        assert data.ids == sorted(s.sample_id for s in samples)

    def named(data: FeaturesData, epoch: int) -> list[list[str]]:
        return [[data.ids[p] for p in b] for b in data.plan(data.split.train, 64, seed=0, epoch=epoch)]

    assert [forward.ids[p] for p in forward.split.heldout] == [backward.ids[p] for p in backward.split.heldout]
    assert named(forward, 0) == named(backward, 0) and named(forward, 1) == named(backward, 1)
    batch = forward.plan(forward.split.train, 64, seed=0, epoch=0)[0]
    assert np.array_equal(forward.load(batch).final.numpy(), backward.load(batch).final.numpy())


def test_extra_replies_split_with_their_prompt(tmp_path: Path) -> None:
    """``<base>~s<k>`` (eagle3 distill --sampled-replies) hashes as ``<base>``: every reply to a training
    prompt trains; a held-out prompt keeps only its main reply in the held-out split, the extra ones are
    in neither split (none trained on, none scored)."""
    bases = [f"p{i}-distill" for i in range(40)]
    held_bases = {b for b in bases if is_heldout(b, 0.2)}
    assert held_bases and len(held_bases) < len(bases)
    samples = random_samples(40 * 3, 97, min_len=5, max_len=12, seed=2)
    ids = [b if k == 0 else variant_id(b, k) for b in bases for k in range(3)]
    renamed = [dataclasses.replace(s, sample_id=i) for s, i in zip(samples, ids, strict=True)]
    features = write_features(renamed, tmp_path / "features", tiny_llama_dir(tmp_path / "model", hidden_size=32))
    data = FeaturesData(features, heldout_fraction=0.2)
    names = data.ids  # canonical order: sorted ids
    assert names == sorted(data.reader.sample_ids)
    assert sorted(names[p] for p in data.split.heldout) == sorted(held_bases)
    assert {names[p] for p in data.split.train} == {i for i in ids if variant_of(i)[0] not in held_bases}
    assert data.split.n_dropped == 2 * len(held_bases)
    assert variant_of("a~s2") == ("a", 2) and variant_of("a~s0") == ("a~s0", 0) and variant_of("~s1") == ("~s1", 0)
    assert variant_of("x~s12") == ("x", 12) and variant_of("x~sy") == ("x~sy", 0)
    with pytest.raises(ValueError, match="start at 1"):
        variant_id("a", 0)


def test_packed_batch_matches_the_reader(features: Path) -> None:
    data = FeaturesData(features)
    batch = data.load([3, 0])
    first, second = data.sample(3), data.sample(0)
    assert (first.sample_id, second.sample_id) == (data.ids[3], data.ids[0])
    n = first.n_tokens
    assert batch.n_tokens == n + second.n_tokens
    np.testing.assert_array_equal(batch.input_ids[:n].numpy(), first.input_ids)
    np.testing.assert_array_equal(batch.final[n:].numpy(), second.final_hidden_state)
    np.testing.assert_array_equal(batch.aux[:n].numpy(), first.aux_hidden_states.reshape(n, -1))
    assert batch.positions[n].item() == 0 and batch.seg_start[n].item() == n and batch.seg_end[0].item() == n


def test_overlong_sample_is_named(features: Path) -> None:
    data = FeaturesData(features)
    first_long = int(np.nonzero(data.n_tokens > 20)[0][0])
    with pytest.raises(DataError, match=f"'{data.ids[first_long]}' has"):
        data.plan(tuple(range(30)), 20, seed=0, epoch=0, shuffle=False)
    assert data.plan(tuple(range(30)), 20, seed=0, epoch=0, truncate=True)


def test_cli_rejects_unknown_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--features", "f", "--vocab", "v", "--out", "o", "--lr", "1"])
    assert exc.value.code == 2
    assert "'--lr'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval", "x", "--prepared", "p", "--engine", "tgi"])
    assert exc.value.code == 2


def test_cli_train_reports_bad_features(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--features", str(tmp_path), "--vocab", "v", "--out", str(tmp_path / "run"),
                 "--model", "SmolLM2-135M-Instruct"])  # fmt: skip
    assert code == 1
    assert "not a features directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prepared", "p"], "needs --prepared DIR and at least one --server URL"),
        (["--server", "http://127.0.0.1:9"], "needs --prepared DIR and at least one --server URL"),
        (["--features", "f", "--server", "http://127.0.0.1:9", "--prepared", "p"], "give one or the other"),
        ([], "give --features DIR"),
    ],
)
def test_cli_train_data_options(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eagle3 train``: offline (--features) or streamed (--prepared + --server), never both, never neither."""
    code = main(["train", *args, "--vocab", "v", "--out", str(tmp_path / "run"), "--model", "SmolLM2-135M-Instruct"])
    assert code == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        ({"features": "FEAT"}, [], "not a features directory"),  # the config's features are read
        ({"prepared": "p", "features_cache": "c"}, [], "needs --prepared DIR and at least one --server URL"),
        ({"features": "FEAT"}, ["--server", "http://127.0.0.1:9"], "needs --prepared DIR"),
        ({"features": "FEAT", "vocab": ""}, [], "no draft vocabulary: give --vocab DIR"),
        ({"features": "FEAT", "out": ""}, [], "no run directory: give --out DIR"),
    ],
)
def test_cli_train_takes_a_runs_own_config(
    config: dict[str, str], args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eagle3 train --config RUN/config.json`` needs no other flag: vocab, out and the data come from it
    (the servers are flags); what is missing is named with its flag and its config key."""
    import json

    values = {"vocab": "v", "out": str(tmp_path / "run"), "model": "SmolLM2-135M-Instruct", **config}
    values = {k: (str(tmp_path) if v == "FEAT" else v) for k, v in values.items()}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    assert main(["train", "--config", str(path), *args]) == 1
    assert message in capsys.readouterr().err


def test_the_demo_trains_a_sample_longer_than_its_micro_batch(features: Path) -> None:
    """``eagle3 demo --reply-tokens 96`` distilled a 3,343-token conversation, over the demo's 512-token
    micro-batch: the run failed at its first step. The demo's settings cut such a sample instead (here a
    budget of 32 tokens against samples of up to 40, the same shape)."""
    from eagle3.demo import DEMO_TRAIN

    cfg = load_config(None, {**DEMO_TRAIN, "max_batch_tokens": 32})
    data = FeaturesData(features, heldout_fraction=0.0)
    assert max(int(n) for n in data.n_tokens) > cfg.max_batch_tokens
    plan = data.plan(data.split.train, cfg.max_batch_tokens, seed=0, epoch=0, truncate=cfg.truncate)
    assert sorted(p for b in plan for p in b) == sorted(data.split.train)
    longest = int(np.argmax(data.n_tokens))
    (alone,) = [b for b in plan if longest in b]
    batch = data.load(alone, cfg.max_batch_tokens)
    assert batch.input_ids.shape[-1] == cfg.max_batch_tokens  # its first 32 tokens
