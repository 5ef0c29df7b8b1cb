"""FeaturesWriter: shards + manifest on disk, resume after crashes, full disk, free-disk pre-check."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from eagle3.client.errors import FeaturesWriteError, IncompatibleError, InsufficientDiskError
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_writer import FeaturesWriter, check_free_disk
from eagle3.core.protocol.features import MANIFEST_FILE, SHARDS_DIR, FeaturesFormatError, FeaturesMeta, iter_manifest
from eagle3.core.sample import ExtractedSample
from tests.unit.sdk_fake import AUX, FINAL, HIDDEN, TOKENIZER_SHA, expected_hidden

META = FeaturesMeta("fake-llama", "r1", AUX, FINAL, HIDDEN, 256, "bfloat16", TOKENIZER_SHA)
ROW_BYTES = (len(AUX) + 1) * HIDDEN * 2


def sample(i: int, n: int | None = None) -> ExtractedSample:
    n = n or 3 + i % 5
    ids = [(i * 31 + t) % 250 + 1 for t in range(n)]
    mask = [t % 2 for t in range(n)]
    return ExtractedSample(
        f"s{i}", np.asarray(ids, np.int32), np.asarray(mask, np.uint8), expected_hidden(ids), AUX, FINAL
    )


def write(out: Path, samples: list[ExtractedSample], shard_mb: int = 1) -> FeaturesWriter:
    writer = FeaturesWriter.open(out, META, shard_mb=shard_mb)
    for s in samples:
        writer.add(s)
    writer.close()
    return writer


def shard_files(out: Path) -> list[str]:
    return sorted(p.name for p in (out / SHARDS_DIR).iterdir())


def test_shards_fill_up_to_the_size_target(tmp_path):
    writer = FeaturesWriter.open(tmp_path, META, shard_mb=1)
    big = (1 << 20) // (ROW_BYTES + 5) // 3  # rows: three samples fill a shard
    for i in range(7):
        writer.add(sample(i, big))
        assert writer.buffered_bytes <= 1 << 20
    writer.close()
    records = list(iter_manifest(tmp_path))
    assert [len(r.sample_ids) for r in records] == [3, 3, 1]
    assert [r.shard for r in records] == shard_files(tmp_path)
    assert writer.n_samples_written == 7 and writer.bytes_written == sum(r.bytes for r in records)


def test_resume_with_partial_manifest_orphan_shard_and_torn_tail(tmp_path):
    write(tmp_path, [sample(i) for i in range(4)], shard_mb=1)
    (tmp_path / SHARDS_DIR / "shard-000009-deadbeef.safetensors").write_bytes(b"orphan: renamed, never recorded")
    (tmp_path / SHARDS_DIR / ".shard-000010-x.safetensors.1234.tmp").write_bytes(b"half written")
    manifest = tmp_path / MANIFEST_FILE
    good = manifest.read_bytes()
    with open(manifest, "ab") as fh:
        fh.write(b'{"shard":"shard-000009-deadbeef.safetensors","sample_ids":["s9"')  # crash mid-append
    writer = FeaturesWriter.open(tmp_path, META, shard_mb=1)
    assert writer.done_ids == {"s0", "s1", "s2", "s3"}
    assert manifest.read_bytes() == good  # torn tail cut, so appends start on a fresh line
    assert len(shard_files(tmp_path)) == 1  # orphans gone
    for i in range(4, 6):
        writer.add(sample(i))
    writer.close()
    reader = FeaturesReader(tmp_path, verify=True)
    assert reader.sample_ids == [f"s{i}" for i in range(6)]
    np.testing.assert_array_equal(reader["s5"].hidden_states_bf16, sample(5).hidden_states_bf16)


def test_a_recorded_shard_that_is_missing_or_resized_fails_loudly(tmp_path):
    write(tmp_path, [sample(0)])
    (shard,) = (tmp_path / SHARDS_DIR).iterdir()
    with open(shard, "ab") as fh:
        fh.write(b"x")
    with pytest.raises(FeaturesFormatError, match="damaged"):
        FeaturesWriter.open(tmp_path, META)
    shard.unlink()
    with pytest.raises(FeaturesFormatError, match="missing"):
        FeaturesWriter.open(tmp_path, META)


def test_verify_catches_a_flipped_byte(tmp_path):
    write(tmp_path, [sample(0)])
    (shard,) = (tmp_path / SHARDS_DIR).iterdir()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    FeaturesWriter.open(tmp_path, META)  # sizes match: the cheap check passes
    with pytest.raises(FeaturesFormatError, match="checksum differs"):
        FeaturesWriter.open(tmp_path, META, verify=True)


def test_old_manifests_with_sha256_still_verify_and_new_ones_carry_xxh3(tmp_path):
    import hashlib
    import json

    write(tmp_path, [sample(0)])
    manifest = tmp_path / MANIFEST_FILE
    line = json.loads(manifest.read_text())
    (shard,) = (tmp_path / SHARDS_DIR).iterdir()
    assert "sha256" not in line and len(line["xxh3_128"]) == 32
    old = {k: v for k, v in line.items() if k != "xxh3_128"}  # a manifest line as older writers made it
    old["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(old) + "\n")
    FeaturesWriter.open(tmp_path, META, verify=True)
    old["sha256"] = "0" * 64
    manifest.write_text(json.dumps(old) + "\n")
    with pytest.raises(FeaturesFormatError, match="checksum differs"):
        FeaturesWriter.open(tmp_path, META, verify=True)


def test_resume_against_another_model_is_refused(tmp_path):
    write(tmp_path, [sample(0)])
    other = FeaturesMeta("fake-llama", "r2", AUX, FINAL, HIDDEN, 256, "bfloat16", TOKENIZER_SHA)
    with pytest.raises(IncompatibleError, match="revision: 'r1' -> 'r2'"):
        FeaturesWriter.open(tmp_path, other)
    wider = FeaturesMeta("fake-llama", "r1", (1, 3), FINAL, HIDDEN, 256, "bfloat16", TOKENIZER_SHA)
    with pytest.raises(IncompatibleError, match="aux_layer_ids"):
        FeaturesWriter.open(tmp_path, wider)


def test_full_disk_is_a_clear_error_and_the_manifest_stays_valid(tmp_path, monkeypatch):
    writer = FeaturesWriter.open(tmp_path, META, shard_mb=1)
    writer.add(sample(0))
    writer.flush()
    real_write = os.write

    class FullFile:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

    import builtins

    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return FullFile(fh) if str(path).endswith(".tmp") and "w" in mode else fh

    monkeypatch.setattr(builtins, "open", full_open)
    writer.add(sample(1))
    with pytest.raises(FeaturesWriteError, match=r"disk full while writing shard .* 1 shards in manifest.jsonl"):
        writer.flush()
    monkeypatch.setattr(builtins, "open", real_open)
    assert os.write is real_write
    assert len(shard_files(tmp_path)) == 1  # the .tmp is gone
    reader = FeaturesReader(tmp_path, verify=True)
    assert reader.sample_ids == ["s0"]
    writer.release()  # the failed run ends (its process exits): the directory lock goes with it
    resumed = FeaturesWriter.open(tmp_path, META)
    assert resumed.done_ids == {"s0"}


def test_full_disk_while_appending_the_manifest_leaves_an_orphan_only(tmp_path, monkeypatch):
    writer = FeaturesWriter.open(tmp_path, META)
    writer.add(sample(0))
    writer.flush()
    import builtins

    real_open = builtins.open

    class Torn:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[:10])  # part of the line lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.fh, name)

    def torn_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return Torn(fh) if str(path).endswith(MANIFEST_FILE) and "a" in mode else fh

    monkeypatch.setattr(builtins, "open", torn_open)
    writer.add(sample(1))
    with pytest.raises(FeaturesWriteError, match="disk full while recording"):
        writer.flush()
    monkeypatch.setattr(builtins, "open", real_open)
    lines = (tmp_path / MANIFEST_FILE).read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["sample_ids"] == ["s0"]
    writer.release()  # the failed run ends: its directory lock goes with it
    assert FeaturesWriter.open(tmp_path, META).done_ids == {"s0"}


def test_free_disk_precheck_says_how_much_is_needed(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=100 << 20))
    check_free_disk(tmp_path, 1000, META, shard_mb=1)
    with pytest.raises(InsufficientDiskError, match=r"need about 1\.0\d GB .* only 0\.10 GB free"):
        check_free_disk(tmp_path, 10_000_000, META, shard_mb=1)


def test_adding_a_sample_twice_or_of_the_wrong_shape_is_refused(tmp_path):
    writer = FeaturesWriter.open(tmp_path, META)
    writer.add(sample(0))
    with pytest.raises(FeaturesFormatError, match="already"):
        writer.add(sample(0))
    s = sample(1)
    wrong = ExtractedSample("w", s.input_ids, s.loss_mask, s.hidden_states_bf16[:, :2], AUX, FINAL)
    with pytest.raises(IncompatibleError, match="states"):
        writer.add(wrong)


def test_background_writer_makes_the_same_shards_in_order_and_raises_its_errors(tmp_path, monkeypatch):
    big = (1 << 20) // (ROW_BYTES + 5) // 3  # rows: three samples fill a 1 MiB shard
    samples = [sample(i, big) for i in range(10)]
    sync_dir, bg_dir = tmp_path / "sync", tmp_path / "bg"
    write(sync_dir, samples)
    writer = FeaturesWriter.open(bg_dir, META, shard_mb=1, background=True)
    for s in samples:
        writer.add(s)
    writer.close()
    sync_records, bg_records = list(iter_manifest(sync_dir)), list(iter_manifest(bg_dir))
    assert [r.sample_ids for r in bg_records] == [r.sample_ids for r in sync_records]
    assert [r.shard[:12] for r in bg_records] == [f"shard-{i:06d}" for i in range(len(bg_records))]
    with FeaturesReader(bg_dir, verify=True) as bg, FeaturesReader(sync_dir) as ref:
        for s in ref:
            assert np.array_equal(bg[s.sample_id].hidden_states_bf16, s.hidden_states_bf16)
    # a background failure surfaces on the next call that waits for it
    import builtins

    real_open = builtins.open

    def full_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(".tmp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    writer = FeaturesWriter.open(tmp_path / "full", META, shard_mb=1, background=True)
    monkeypatch.setattr(builtins, "open", full_open)
    for s in samples[:3]:
        writer.add(s)  # the third fills the shard: written in the background, fails there
    with pytest.raises(FeaturesWriteError, match="disk full while writing shard"):
        writer.flush()
    writer.shutdown()


def test_background_shards_are_written_while_filling_and_read_back_by_the_safetensors_library(tmp_path):
    """The background writer puts each sample's states into the shard's .tmp as it is added (before
    the shard is full) and the header, padded to its reserved room, last: the shard is a valid
    safetensors file for the reference library, with the tensors the synchronous writer writes."""
    import torch
    from safetensors.torch import load_file

    big = (1 << 20) // (ROW_BYTES + 5) // 3
    samples = [sample(i, big) for i in range(5)]
    write(tmp_path / "sync", samples)
    writer = FeaturesWriter.open(tmp_path / "bg", META, shard_mb=1, background=True)
    writer.add(samples[0])
    writer.add(samples[1])
    writer._pool.submit(lambda: None).result()  # type: ignore[union-attr]  # the writer thread caught up
    tmp = [p for p in (tmp_path / "bg" / SHARDS_DIR).iterdir() if p.name.endswith(".tmp")]
    states_bytes = sum(s.hidden_states_bf16.nbytes for s in samples[:2])
    assert len(tmp) == 1 and tmp[0].stat().st_size == writer.header_bytes + states_bytes  # on disk already
    for s in samples[2:]:
        writer.add(s)
    writer.close()
    sync_records, bg_records = list(iter_manifest(tmp_path / "sync")), list(iter_manifest(tmp_path / "bg"))
    assert [r.sample_ids for r in bg_records] == [r.sample_ids for r in sync_records]
    for got, want in zip(bg_records, sync_records, strict=True):
        a = load_file(str(tmp_path / "bg" / SHARDS_DIR / got.shard))
        b = load_file(str(tmp_path / "sync" / SHARDS_DIR / want.shard))
        assert sorted(a) == sorted(b) == ["hidden_states", "input_ids", "loss_mask", "sample_offsets"]
        for name in b:  # bit for bit (bf16 compared as int16)
            x, y = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in (a[name], b[name]))
            assert torch.equal(x, y), name
        assert got.bytes == (tmp_path / "bg" / SHARDS_DIR / got.shard).stat().st_size
    reader = FeaturesReader(tmp_path / "bg", verify=True)  # xxh3-128 of each file equals its manifest line
    assert reader.sample_ids == [s.sample_id for s in samples]
    assert shard_files(tmp_path / "bg") == sorted(r.shard for r in bg_records)  # no .tmp left


def test_background_shard_ends_when_its_header_room_is_full(tmp_path):
    """Many samples with long ids: a background shard ends before its ids overflow the header room
    (4 KiB for a 1 MiB shard), and every shard still verifies and reads back."""
    long_ids = [
        ExtractedSample(f"{i:04d}-" + "x" * 200, s.input_ids, s.loss_mask, s.hidden_states_bf16, AUX, FINAL)
        for i, s in enumerate(sample(i, 2) for i in range(60))
    ]
    writer = FeaturesWriter.open(tmp_path, META, shard_mb=1, background=True)
    for s in long_ids:
        writer.add(s)
    writer.close()
    records = list(iter_manifest(tmp_path))
    assert len(records) > 1 and sum(len(r.sample_ids) for r in records) == 60
    for r in records:
        with open(tmp_path / SHARDS_DIR / r.shard, "rb") as fh:
            assert int.from_bytes(fh.read(8), "little") + 8 == writer.header_bytes
    reader = FeaturesReader(tmp_path, verify=True)
    assert reader.sample_ids == [s.sample_id for s in long_ids]
    np.testing.assert_array_equal(reader[long_ids[-1].sample_id].hidden_states_bf16, long_ids[-1].hidden_states_bf16)
