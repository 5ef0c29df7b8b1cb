"""Identity by content through live ``eagle3 serve`` processes (issue 31 R2).

Two checkpoints that differ only in their weight bytes: ``run1/final`` (a tiny random Llama) and
``run2/final``, its copy with one matrix times 1.05 (every file the same size, the same directory
name). A server of the second, started on the first one's ``--feature-cache-dir``, reports another revision,
computes every sample (no hit: the first one's states are never served) and its states differ; and
``eagle3 extract`` resuming the first one's features directory with it refuses to mix the two.
A restart of an unchanged checkpoint reports the same revision without hashing its weights again.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from eagle3.client.errors import IncompatibleError
from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.sdk import ExtractionClient
from eagle3.core.identity import tokenizer_sha256
from eagle3.core.protocol import PreparedMeta, PreparedSample
from tests.e2e.live_server import LiveServer, file_sizes, scaled_copy, tiny_llama_dir

KEYS = {"alice": "key-alice"}


def serve(tmp_path: Path, model: Path, name: str, cache_dir: Path) -> LiveServer:
    args = [
        "--backend",
        "hf",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-batch-tokens",
        "512",
        "--feature-cache-dir",
        str(cache_dir),
    ]
    live = LiveServer(args, tmp_path / f"{name}.log", api_keys=KEYS)
    live.wait_ready(timeout_s=180)
    return live


def states(live: LiveServer, samples: list[PreparedSample]) -> dict[str, np.ndarray]:
    with ExtractionClient(live.url, KEYS["alice"]) as client:
        reqs = [{"id": s.sample_id, "input_ids": s.input_ids} for s in samples]
        return {s.sample_id: np.array(s.hidden_states_bf16) for s in client.extract(reqs)}


def prepared_dir(path: Path, model: Path, n: int) -> list[PreparedSample]:
    rng = random.Random(0)
    token_ids = [[rng.randrange(1, 512) for _ in range(rng.randrange(4, 40))] for _ in range(n)]
    rows = [PreparedSample(f"s{i}", ids, [1] * len(ids), f"in.jsonl:{i + 1}") for i, ids in enumerate(token_ids)]
    path.mkdir()
    (path / "samples.jsonl").write_text("".join(r.to_json() + "\n" for r in rows))
    meta = PreparedMeta("tiny", str(model), tokenizer_sha256(model), "", 512, 512, "drop", ["in.jsonl"])
    (path / "meta.json").write_text(meta.to_json())
    return rows


def test_a_same_size_fine_tune_is_another_checkpoint_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "eagle3-cache"))  # the servers' digest sidecars
    first = tiny_llama_dir(tmp_path / "run1" / "final")
    tuned = scaled_copy(first, tmp_path / "run2" / "final")
    assert file_sizes(tuned) == file_sizes(first)
    rows = prepared_dir(tmp_path / "prepared", first, 10)
    cache_dir, out = tmp_path / "feature-cache", tmp_path / "features"
    config = ExtractConfig(progress=False, max_retries=1)

    with serve(tmp_path, first, "first", cache_dir) as live:
        info_first = ExtractionClient(live.url, KEYS["alice"]).info()
        want = states(live, rows)
        assert live.metrics()["eagle3_cache_misses_total"] == len(rows)
        extract_dataset(tmp_path / "prepared", out, live.url, KEYS["alice"], ExtractConfig(progress=False, limit=4))

    with serve(tmp_path, tuned, "tuned", cache_dir) as live:
        info_tuned = ExtractionClient(live.url, KEYS["alice"]).info()
        got = states(live, rows)
        m = live.metrics()
        assert m.get("eagle3_cache_hits_total", 0) == 0, "the first checkpoint's cached states were served"
        assert m["eagle3_cache_misses_total"] == len(rows)
        assert not any(np.array_equal(got[k], want[k]) for k in want), "the tuned copy's states equal the first's"
        with pytest.raises(IncompatibleError, match="revision") as refused:
            extract_dataset(tmp_path / "prepared", out, live.url, KEYS["alice"], config)
        assert str(out) in str(refused.value)
    assert info_tuned.model_id == info_first.model_id == "final"
    assert info_tuned.revision != info_first.revision
    assert json.loads((out / "features.json").read_text())["revision"] == info_first.revision

    with serve(tmp_path, first, "again", cache_dir) as live:  # a restart: same revision, nothing re-hashed
        assert ExtractionClient(live.url, KEYS["alice"]).info().revision == info_first.revision
        assert states(live, rows).keys() == want.keys()
        assert live.metrics()['eagle3_cache_hits_total{tier="disk"}'] == len(rows)
        summary = extract_dataset(tmp_path / "prepared", out, live.url, KEYS["alice"], config)
        assert summary.n_skipped == 4 and summary.n_samples == len(rows) - 4
    assert "hashed" in (tmp_path / "first.log").read_text()  # the weights were read once, on the first start
    assert "hashed" not in (tmp_path / "again.log").read_text()
