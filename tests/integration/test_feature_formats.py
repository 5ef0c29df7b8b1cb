"""Features that fit the disk (issue 33, item 4): a features directory stored compressed (zstd per sample)
reads back bitwise equal to the raw one; FP8 directories hold exactly ``core/fp8.py``'s quantization of
the lossless states; every directory records its format (features.json, each manifest line, each shard)
and one of mixed formats is refused, naming the directory and the fix; the trainer trains from FP8.

The states are a real forward pass of a tiny random Llama (``tests/trainer_helpers.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.core.codec import parse_safetensors
from eagle3.core.errors import IncompatibleError
from eagle3.core.features_convert import convert_features
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.fp8 import quantize_states
from eagle3.core.protocol.features import (
    DTYPE_BF16,
    DTYPE_FP8,
    MANIFEST_FILE,
    SHARDS_DIR,
    FeaturesFormatError,
    iter_manifest,
    read_features_meta,
)
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.data import FeaturesData
from eagle3.draft_trainer.train import METRICS_FILE, train
from tests.trainer_helpers import training_files

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    files = training_files(root, 40, seed=5)
    raw = Path(files["features"])
    out = {"raw": raw, "vocab": Path(files["vocab"]), "model": Path(files["model"])}
    for name, dtype, compress in (("zstd", DTYPE_BF16, True), ("fp8", DTYPE_FP8, False), ("fp8_zstd", DTYPE_FP8, True)):
        convert_features(raw, root / name, dtype, compress=compress, shard_mb=0.05)  # background writer
        out[name] = root / name
    return out


def _shard_bytes(features: Path) -> int:
    return sum(p.stat().st_size for p in (features / SHARDS_DIR).iterdir())


def test_compressed_shards_read_back_bitwise_equal_to_raw(dirs: dict[str, Path], tmp_path: Path) -> None:
    raw, packed = FeaturesReader(dirs["raw"]), FeaturesReader(dirs["zstd"], verify=True)
    # the foreground writer (shards written whole at flush) too, with a shard per few samples
    direct = tmp_path / "direct"
    writer = FeaturesWriter.open(direct, read_features_meta(dirs["zstd"]), shard_mb=0.02)
    for sample in raw:
        writer.add(sample)
    writer.close()
    assert len(list(iter_manifest(direct))) > 1
    for other in (packed, FeaturesReader(direct)):
        assert other.sample_ids == raw.sample_ids or sorted(other.sample_ids) == sorted(raw.sample_ids)
        for sample in raw:
            got = other[sample.sample_id]
            assert got.states.dtype == np.uint16 and np.array_equal(got.states, sample.states)
            assert np.array_equal(got.input_ids, sample.input_ids) and np.array_equal(got.loss_mask, sample.loss_mask)
    fp8, fp8_zstd = FeaturesReader(dirs["fp8"]), FeaturesReader(dirs["fp8_zstd"], verify=True)
    for sample in fp8:
        got = fp8_zstd[sample.sample_id]
        assert np.array_equal(got.states, sample.states) and np.array_equal(
            np.asarray(got.fp8_scales), np.asarray(sample.fp8_scales)
        )
    assert _shard_bytes(dirs["zstd"]) < _shard_bytes(dirs["raw"])
    assert _shard_bytes(dirs["fp8_zstd"]) < _shard_bytes(dirs["fp8"])


def test_fp8_directory_holds_the_quantized_lossless_states(dirs: dict[str, Path]) -> None:
    raw, fp8 = FeaturesReader(dirs["raw"]), FeaturesReader(dirs["fp8"])
    for sample in raw:
        codes, scales = quantize_states(sample.states_float32())
        got = fp8[sample.sample_id]
        assert got.is_fp8 and got.states.dtype == np.uint8
        assert np.array_equal(got.states, codes) and np.array_equal(np.asarray(got.fp8_scales), scales)
        # per token and layer, the dequantized states are within e4m3's half-ulp (2^-4 relative) of the originals
        exact, back = sample.states_float32(), got.states_float32()
        amax = np.abs(exact).max(axis=-1, keepdims=True)
        assert np.all(np.abs(back - exact) <= np.maximum(np.abs(exact) / 16, amax / 448 * 2.0**-10) * 1.0001)
    # one byte per value and a float32 scale per layer instead of two bytes per value: (H + 4) / 2H at H = 32,
    # plus the ids, masks and headers both have
    ratio = _shard_bytes(dirs["fp8"]) / _shard_bytes(dirs["raw"])
    assert (32 + 4) / 64 < ratio < (32 + 4) / 64 + 0.06


def test_a_features_directory_records_its_format(dirs: dict[str, Path]) -> None:
    for name, fmt in (("raw", "bfloat16/none"), ("zstd", "bfloat16/zstd+planes"), ("fp8", "float8_e4m3fn/none"),
                      ("fp8_zstd", "float8_e4m3fn/zstd")):  # fmt: skip
        assert read_features_meta(dirs[name]).feature_format == fmt
        meta = json.loads((dirs[name] / "features.json").read_text())
        assert f"{meta['dtype']}/{meta['shard_codec']}" == fmt
        for record in iter_manifest(dirs[name]):
            assert record.feature_format == fmt
            blob = (dirs[name] / SHARDS_DIR / record.shard).read_bytes()
            tensors, shard_meta = parse_safetensors(blob)
            assert f"{shard_meta['dtype']}/{shard_meta['codec']}" == fmt
            assert ("hidden_scales" in tensors) == fmt.startswith("float8")
    raw_line = (dirs["raw"] / MANIFEST_FILE).read_text().splitlines()[0]
    assert '"dtype"' not in raw_line and '"codec"' not in raw_line  # lossless lines as before: old readers read them


def test_mixed_formats_are_refused_naming_the_directory_and_the_fix(dirs: dict[str, Path], tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(dirs["raw"], mixed)
    fp8_record = next(iter_manifest(dirs["fp8"]))
    shutil.copy(dirs["fp8"] / SHARDS_DIR / fp8_record.shard, mixed / SHARDS_DIR / fp8_record.shard)
    kept = [r for r in iter_manifest(mixed) if not set(r.sample_ids) & set(fp8_record.sample_ids)]
    (mixed / MANIFEST_FILE).write_text("".join(r.to_line() for r in [*kept, fp8_record]))
    for open_it in (FeaturesReader, FeaturesData):
        with pytest.raises(FeaturesFormatError) as info:
            open_it(mixed)
        message = str(info.value)
        assert str(mixed) in message and "mixed feature formats" in message and fp8_record.shard in message
        assert "float8_e4m3fn/none" in message and "bfloat16/none" in message and "re-extract" in message
    # resuming a directory with another format, and an FP8 sample into a lossless directory
    with pytest.raises(IncompatibleError, match=f"{dirs['raw']} holds bfloat16/none features.*--feature-dtype"):
        FeaturesWriter.open(dirs["raw"], read_features_meta(dirs["fp8"]))
    writer = FeaturesWriter.open(tmp_path / "lossless", read_features_meta(dirs["raw"]))
    with pytest.raises(IncompatibleError, match="is FP8 and .* stores bfloat16"):
        writer.add(FeaturesReader(dirs["fp8"])[0])
    writer.close()
    with pytest.raises(FeaturesFormatError, match="would not bring back"):
        convert_features(dirs["fp8"], tmp_path / "back", DTYPE_BF16)


def test_the_trainer_trains_from_an_fp8_directory(dirs: dict[str, Path], tmp_path: Path) -> None:
    lossless, fp8 = FeaturesData(dirs["raw"]), FeaturesData(dirs["fp8_zstd"])
    assert fp8.ids == lossless.ids and np.array_equal(fp8.n_tokens, lossless.n_tokens)
    batch, exact = fp8.load([0, 1]), lossless.load([0, 1])
    want = np.concatenate([FeaturesReader(dirs["fp8"])[lossless.ids[p]].states_float32() for p in (0, 1)])
    assert np.array_equal(batch.final.numpy(), want[:, -1]) and np.array_equal(
        batch.aux.numpy(), want[:, :-1].reshape(len(want), -1)
    )
    assert not np.array_equal(batch.final.numpy(), exact.final.numpy())  # dequantized, not the lossless states
    settings = {"features": str(dirs["fp8_zstd"]), "vocab": str(dirs["vocab"]), "model": str(dirs["model"]),
                "out": str(tmp_path / "run"), "ttt_steps": "2", "max_batch_tokens": "96", "epochs": "3",
                "progress": "false", "lr": "3e-3", "warmup_steps": "2", "device": "cpu"}  # fmt: skip
    result = train(load_config(None, settings))
    assert result.steps > 0 and not result.stopped_early
    losses = [
        r["loss"] for r in map(json.loads, (tmp_path / "run" / METRICS_FILE).read_text().splitlines()) if "loss" in r
    ]
    assert len(losses) == result.steps and np.isfinite(losses).all() and np.mean(losses[-3:]) < np.mean(losses[:3])


def test_read_ahead_gives_the_batches_read_in_the_step(dirs: dict[str, Path]) -> None:
    for name in ("raw", "fp8_zstd"):
        inline, ahead = FeaturesData(dirs[name]), FeaturesData(dirs[name], loader_threads=2)
        plan = inline.plan(inline.split.train, 64, seed=1, epoch=0)
        ahead.begin(plan)
        held = inline.load(list(inline.split.heldout))  # a batch not announced: read at once, the window kept
        assert torch.equal(ahead.load(list(inline.split.heldout)).aux, held.aux)
        for batch in plan:
            want, got = inline.load(batch), ahead.load(batch)
            for field in ("input_ids", "aux", "final", "loss_mask", "positions", "seg_start", "seg_end"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)
        assert not ahead._ahead  # every batch read ahead was taken
        ahead.close()


def test_eagle3_convert_writes_another_format(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3.cli import main

    out = tmp_path / "cli_fp8"
    assert main(["convert", str(dirs["raw"]), "--to", "eagle3", "--feature-dtype", "fp8", "--compress-shards",
                 "--out", str(out)]) == 0  # fmt: skip
    assert "bfloat16/none" in capsys.readouterr().out and read_features_meta(out).feature_format == "float8_e4m3fn/zstd"
    fp8 = FeaturesReader(dirs["fp8"])
    for sample in FeaturesReader(out):
        assert np.array_equal(sample.states, fp8[sample.sample_id].states)
    assert (
        main(["convert", str(dirs["raw"]), "--to", "specforge", "--feature-dtype", "fp8", "--out", str(tmp_path / "x")])
        == 1
    )
    assert "only for an eagle3 features directory" in capsys.readouterr().err


def test_features_dataset_reads_every_format(dirs: dict[str, Path]) -> None:
    from eagle3.core.features_dataset import FeaturesDataset

    raw = FeaturesDataset(dirs["raw"])
    for name in ("zstd", "fp8", "fp8_zstd"):
        other = FeaturesDataset(dirs[name], sample_ids=raw.sample_ids[:4])
        for index in range(4):
            want, got = raw[index], other[index]
            assert got["sample_id"] == want["sample_id"] and got["hidden_states"].dtype == torch.bfloat16
            if name == "zstd":
                assert torch.equal(got["hidden_states"], want["hidden_states"])
            else:  # FP8: dequantized, then rounded to bf16 (within e4m3's 2^-4 of the lossless value)
                exact, back = want["hidden_states"].float(), got["hidden_states"].float()
                assert torch.all((back - exact).abs() <= exact.abs() / 16 + exact.abs().amax(-1, keepdim=True) / 448)


def test_a_compact_batch_widened_on_its_device_equals_the_host_batch(dirs: dict[str, Path]) -> None:
    """``compact`` (CUDA training): the states travel as stored and are widened on the device; here the
    device is the CPU, the same torch ops as on a GPU, and the batch must be ``pack``'s bit for bit."""
    cpu = torch.device("cpu")
    for name in ("raw", "zstd", "fp8", "fp8_zstd"):
        host, compact = FeaturesData(dirs[name]), FeaturesData(dirs[name], compact=True, loader_threads=1)
        plan = host.plan(host.split.train, 64, seed=2, epoch=0)
        compact.begin(plan)
        for batch in plan:
            want, got = host.load(batch), compact.load_to(batch, None, cpu)
            for field in ("input_ids", "aux", "final", "loss_mask", "positions", "seg_start", "seg_end"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (name, field)
        compact.close()
