"""FP8 over HTTP (issue 33, item 4): ``/v1/extract`` with ``"dtype": "float8_e4m3fn"`` from a live hf server
on the embedded SmolLM2 writes exactly ``core/fp8.py``'s quantization of the lossless states the same
server sends (computed, and served from its feature cache), through the SDK and ``eagle3 extract
--feature-dtype fp8 --compress-shards``; ``eagle3 train --server`` refuses a ``--features-cache`` of
another format than the stream asks for, naming the directory and the fix."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.client.train_source import ServerSource
from eagle3.core.errors import IncompatibleError
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.fp8 import decode_e4m3, quantize_states
from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol.features import DTYPE_FP8, read_features_meta
from eagle3.draft_trainer.stream_data import StreamedData
from tests.e2e.live_server import REPO_ROOT, LiveServer

pytestmark = pytest.mark.e2e
N_SAMPLES = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("fp8serve")
    # fp32: a sample's states do not depend on what shares its batch, so two extractions compare bitwise
    args = ["--model", DEFAULT_MODEL, "--backend", "hf", "--dtype", "float32", "--max-batch-tokens", "1024"]
    with LiveServer(args, root / "serve.log") as live:
        live.wait_ready(timeout_s=180)
        yield live


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("prep") / "prepared"
    prepare_dataset(["builtin:chatterbot"], out, model=DEFAULT_MODEL, config=PrepareConfig(limit=N_SAMPLES))
    return out


def _quantized(lossless: FeaturesReader) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {s.sample_id: quantize_states(s.states_float32()) for s in lossless}


def test_fp8_over_http_writes_the_quantized_lossless_states(server: LiveServer, prepared: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    extract_dataset(prepared, raw, server.url, config=ExtractConfig(progress=False))  # stored in the server's cache
    want = _quantized(FeaturesReader(raw))
    assert len(want) == N_SAMPLES
    computed, cached = tmp_path / "fp8_computed", tmp_path / "fp8_cli"
    fp8_computed = ExtractConfig(progress=False, cache="bypass", feature_dtype=DTYPE_FP8)
    summary = extract_dataset(prepared, computed, server.url, config=fp8_computed)
    cli = subprocess.run(
        [sys.executable, "-m", "eagle3", "extract", str(prepared), "--server", server.url, "--out", str(cached),
         "--feature-dtype", "fp8", "--compress-shards", "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert read_features_meta(computed).feature_format == "float8_e4m3fn/none"
    assert read_features_meta(cached).feature_format == "float8_e4m3fn/zstd"
    for features in (computed, cached):
        reader = FeaturesReader(features, verify=True)
        assert sorted(reader.sample_ids) == sorted(want)
        for sample in reader:
            codes, scales = want[sample.sample_id]
            assert sample.is_fp8 and np.array_equal(sample.states, codes)
            assert np.array_equal(np.asarray(sample.fp8_scales), scales)
    # the wire carried about half the lossless shards' bytes (codes + a scale per token and layer)
    assert summary.wire_bytes < 0.6 * sum(p.stat().st_size for p in (raw / "shards").iterdir())


def test_hybrid_cache_of_another_format_is_refused(server: LiveServer, prepared: Path, tmp_path: Path) -> None:
    lossless = tmp_path / "cache"
    extract_dataset(prepared, lossless, server.url, config=ExtractConfig(progress=False))
    with pytest.raises(IncompatibleError) as info:
        StreamedData(prepared, ServerSource([server.url], dtype=DTYPE_FP8), features_cache=lossless)
    message = str(info.value)
    assert str(lossless) in message and "bfloat16/none" in message and "float8_e4m3fn/none" in message
    assert "--feature-dtype" in message


def test_hybrid_fp8_stream_fills_a_compressed_fp8_cache(server: LiveServer, prepared: Path, tmp_path: Path) -> None:
    """``eagle3 train --server --features-cache DIR --feature-dtype fp8 --compress-shards``: the batches the
    stream hands the trainer, and the cache it writes, are the quantized lossless states."""
    raw = tmp_path / "raw"
    extract_dataset(prepared, raw, server.url, config=ExtractConfig(progress=False))
    want = _quantized(FeaturesReader(raw))
    cache = tmp_path / "cache"
    source = ServerSource([server.url], dtype=DTYPE_FP8, compress_shards=True)
    data = StreamedData(prepared, source, features_cache=cache, max_batch_tokens=4096, heldout_fraction=0.0001)
    plan = data.plan(data.split.train, 4096, seed=0, epoch=0)
    data.begin(plan)
    for batch in plan:
        packed = data.load(batch)
        codes, scales = (np.concatenate(a) for a in zip(*(want[data.ids[p]] for p in batch), strict=True))
        exact = decode_e4m3(codes) * scales[..., None]
        assert np.array_equal(packed.final.numpy(), exact[:, -1])
    data.close()
    source.close()
    assert read_features_meta(cache).feature_format == "float8_e4m3fn/zstd"
    for sample in FeaturesReader(cache, verify=True):
        codes, scales = want[sample.sample_id]
        assert np.array_equal(sample.states, codes) and np.array_equal(np.asarray(sample.fp8_scales), scales)
