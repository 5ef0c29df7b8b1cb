"""prepare -> vocab through the console script on the builtin demo dataset and the real verifier."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol import iter_prepared
from eagle3.draft_trainer.vocab import count_assistant_tokens, load_vocab

pytestmark = pytest.mark.integration


def eagle3(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("eagle3") or ""
    cmd = [exe] if exe else [sys.executable, "-m", "eagle3"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, check=False, timeout=600)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "prepared"
    proc = eagle3("prepare", "--input", "builtin:chatterbot", "--out", str(out), "--model", DEFAULT_MODEL)
    assert proc.returncode == 0, proc.stderr
    assert "kept             2,026 samples" in proc.stdout
    assert "length histogram" in proc.stdout and "assistant (" in proc.stdout
    return Path(out)


def test_prepare_prints_and_writes_stats(prepared):
    stats = json.loads((prepared / "stats.json").read_text())
    samples = list(iter_prepared(prepared))
    assert stats["samples_kept"] == len(samples) == 2026
    assert stats["assistant_tokens"] == sum(s.n_assistant_tokens for s in samples)
    assert sum(b["count"] for b in stats["length_histogram"]) == len(samples)


def test_vocab_larger_than_distinct_tokens_pads_to_full_coverage(prepared, tmp_path):
    proc = eagle3("vocab", "--prepared", str(prepared), "--draft-vocab-size", "32000", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "coverage          100.00% of assistant-token occurrences" in proc.stdout
    assert "ids with frequency 0" in proc.stdout
    stats = json.loads((tmp_path / "vocab.json").read_text())
    vocab = load_vocab(tmp_path)
    counts = count_assistant_tokens(prepared)
    distinct = np.flatnonzero(counts)
    assert stats["distinct_assistant_tokens"] == distinct.size < 32000
    assert stats["padded_ids"] == 32000 - distinct.size
    assert set(distinct.tolist()) <= set(vocab.target_ids.tolist())  # every seen token is in
    assert np.array_equal(np.arange(32000) + vocab.d2t, np.flatnonzero(vocab.t2d))
    assert vocab.t2d.shape == (49152,) and int(vocab.t2d.sum()) == 32000


def test_small_vocab_coverage_matches_a_direct_count(prepared, tmp_path):
    proc = eagle3("vocab", "--prepared", str(prepared), "--draft-vocab-size", "256", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    # recount the assistant tokens straight from samples.jsonl, independently of the vocab module
    freq: dict[int, int] = {}
    for line in (prepared / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        for t, m in zip(row["input_ids"], row["loss_mask"], strict=True):
            if m:
                freq[t] = freq.get(t, 0) + 1
    top = sorted(freq, key=lambda t: (-freq[t], t))[:256]
    expected = sum(freq[t] for t in top) / sum(freq.values())
    stats = json.loads((tmp_path / "vocab.json").read_text())
    assert stats["coverage"] == pytest.approx(expected)
    assert f"{100 * expected:.2f}%" in proc.stdout
    assert sorted(top) == load_vocab(tmp_path).target_ids.tolist()


def test_vocab_larger_than_target_vocab_is_refused(prepared, tmp_path):
    proc = eagle3("vocab", "--prepared", str(prepared), "--draft-vocab-size", "50000", "--out", str(tmp_path))
    assert proc.returncode == 1
    assert "draft vocab size 50000 is larger than the target vocabulary (49152 tokens)" in proc.stderr
    assert not (tmp_path / "vocab.safetensors").exists()


def test_an_output_path_that_cannot_be_created_is_one_line_not_a_traceback(tmp_path, capsys):
    from eagle3.cli import main

    (tmp_path / "in.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "blocker").write_text("a file, not a directory")
    code = main(["prepare", "--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "blocker" / "out"),
                 "--model", DEFAULT_MODEL])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("eagle3 prepare: error: ") and "blocker" in err and "Traceback" not in err
