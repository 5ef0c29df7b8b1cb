"""``open_features``: a torchrun hybrid cache (``DIR/rank-N``, one features directory per rank) reads as one
set of samples; a plain features directory reads as before; a directory of another model or format is
refused naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_union import FeaturesUnion, open_features, rank_dirs
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import FeaturesFormatError
from tests.unit.test_features_writer import META, sample, write


def test_rank_directories_read_as_one(tmp_path: Path) -> None:
    write(tmp_path / "rank-1", [sample(i) for i in (1, 3, 5)])
    write(tmp_path / "rank-0", [sample(i) for i in (0, 2, 4)])
    write(tmp_path / "rank-10", [sample(9)])
    (tmp_path / "rank-2").mkdir()  # no features.json: not a rank's directory yet
    assert [p.name for p in rank_dirs(tmp_path)] == ["rank-0", "rank-1", "rank-10"]  # by rank, not by name
    union = open_features(tmp_path)
    assert isinstance(union, FeaturesUnion)
    assert union.sample_ids == ["s0", "s2", "s4", "s1", "s3", "s5", "s9"]
    assert union.sample_n_tokens == [sample(int(i[1:])).n_tokens for i in union.sample_ids]
    for sample_id in union.sample_ids:
        want = sample(int(sample_id[1:]))
        np.testing.assert_array_equal(union[sample_id].hidden_states_bf16, want.hidden_states_bf16)
    assert union[3].sample_id == "s1" and "s9" in union and "s7" not in union
    with pytest.raises(KeyError, match="s7"):
        union["s7"]


def test_a_sample_in_two_directories_is_read_from_the_first(tmp_path: Path) -> None:
    write(tmp_path, [sample(0), sample(1)])  # DIR itself (a one-process run), then rank-0 (a later torchrun)
    write(tmp_path / "rank-0", [sample(1), sample(2)])
    union = open_features(tmp_path)
    assert isinstance(union, FeaturesUnion) and union.sample_ids == ["s0", "s1", "s2"]
    assert union.readers[0].dir == tmp_path


def test_a_plain_directory_is_its_own_reader(tmp_path: Path) -> None:
    write(tmp_path, [sample(0)])
    assert isinstance(open_features(tmp_path), FeaturesReader)
    with pytest.raises(FeaturesFormatError, match="not a features directory"):
        open_features(tmp_path / "empty")


def test_another_model_or_format_is_refused_naming_the_directory(tmp_path: Path) -> None:
    write(tmp_path / "rank-0", [sample(0)])
    other = FeaturesWriter.open(tmp_path / "rank-1", dataclasses.replace(META, revision="r2"))
    other.add(sample(1))
    other.close()
    with pytest.raises(FeaturesFormatError, match=r"rank-1 holds features of another model .*revision: 'r1' -> 'r2'"):
        open_features(tmp_path)


def test_every_reader_of_features_takes_a_torchrun_cache(tmp_path: Path) -> None:
    """The notebook Dataset, ``eagle3 convert`` (here: into one plain directory) and iteration read the rank
    directories as one, as the trainer does."""
    from eagle3.core.features_convert import convert_features
    from eagle3.core.features_dataset import FeaturesDataset

    cache = tmp_path / "cache"
    write(cache / "rank-0", [sample(0), sample(2)])
    write(cache / "rank-1", [sample(1)])
    dataset = FeaturesDataset(cache, verify=True)
    assert len(dataset) == 3 and dataset.sample_ids == ["s0", "s2", "s1"]
    assert dataset[2]["sample_id"] == "s1"
    assert [s.sample_id for s in open_features(cache)] == ["s0", "s2", "s1"]
    assert convert_features(cache, tmp_path / "plain", META.dtype) == 3
    plain = open_features(tmp_path / "plain")
    assert isinstance(plain, FeaturesReader) and sorted(plain.sample_ids) == ["s0", "s1", "s2"]
    np.testing.assert_array_equal(plain["s1"].hidden_states_bf16, sample(1).hidden_states_bf16)
