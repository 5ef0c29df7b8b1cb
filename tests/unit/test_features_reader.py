"""FeaturesReader: what the writer wrote comes back equal, by position and by id, memory-mapped; the
same files load with safetensors.torch (the trainer's reader) with the right dtypes and shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle3.core.codec import bf16_to_float32
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.protocol.features import SHARDS_DIR, FeaturesFormatError, iter_manifest
from tests.unit.sdk_fake import AUX, FINAL, HIDDEN
from tests.unit.test_features_writer import ROW_BYTES, sample, write


@pytest.fixture
def written(tmp_path):
    rows = (1 << 20) // ROW_BYTES // 4
    samples = [sample(i, rows if i % 3 == 0 else None) for i in range(10)]
    write(tmp_path, samples, shard_mb=1)
    return tmp_path, samples


def test_read_back_equals_written_by_index_and_by_id(written):
    out, samples = written
    reader = FeaturesReader(out, verify=True)
    assert len(reader) == 10 and len(reader.records) > 1
    assert reader.n_tokens == sum(s.n_tokens for s in samples)
    for position, want in enumerate(samples):
        for got in (reader[position], reader[want.sample_id]):
            assert got.sample_id == want.sample_id
            np.testing.assert_array_equal(got.input_ids, want.input_ids)
            np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
            np.testing.assert_array_equal(got.hidden_states_bf16, want.hidden_states_bf16)
            np.testing.assert_array_equal(got.hidden_states, bf16_to_float32(want.hidden_states_bf16))
            assert got.layer_ids == (*AUX, FINAL)
    assert [s.sample_id for s in reader] == [s.sample_id for s in samples]
    assert reader[-1].sample_id == "s9"
    with pytest.raises(KeyError, match="nope"):
        reader["nope"]
    with pytest.raises(IndexError):
        reader[10]


def test_samples_are_views_into_a_memory_map(written):
    out, _ = written
    reader = FeaturesReader(out)
    states = reader[0].hidden_states_bf16
    assert not states.flags.writeable and not states.flags.owndata  # a view, not a copy


def test_safetensors_torch_loads_the_shards(written):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    out, samples = written
    by_id = {s.sample_id: s for s in samples}
    for record in iter_manifest(out):
        path = out / SHARDS_DIR / record.shard
        tensors = load_file(str(path))
        total = sum(record.n_tokens)
        assert tensors["hidden_states"].dtype == torch.bfloat16
        assert tuple(tensors["hidden_states"].shape) == (total, len(AUX) + 1, HIDDEN)
        assert tensors["input_ids"].dtype == torch.int32 and tensors["loss_mask"].dtype == torch.uint8
        assert tensors["sample_offsets"].dtype == torch.int64
        assert tensors["sample_offsets"].tolist()[-1] == total
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata()
        assert json.loads(meta["sample_ids"]) == list(record.sample_ids)
        assert json.loads(meta["layer_ids"]) == list(AUX) and meta["final_norm_applied"] == "false"
        offsets = tensors["sample_offsets"].tolist()
        for i, sample_id in enumerate(record.sample_ids):
            rows = tensors["hidden_states"][offsets[i] : offsets[i + 1]].float().numpy()
            np.testing.assert_array_equal(rows, by_id[sample_id].hidden_states)


def test_reader_refuses_a_shard_that_disagrees_with_the_manifest(written):
    out, _ = written
    record = next(iter_manifest(out))
    path = out / SHARDS_DIR / record.shard
    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)  # same size, other bytes
    FeaturesReader(out)
    with pytest.raises(FeaturesFormatError, match="checksum differs"):
        FeaturesReader(out, verify=True)
