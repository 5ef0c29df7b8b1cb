"""Progress in a log is line-based: with no terminal (a k8s Job, CI, ``| tee``), prepare, extract,
verify and train write whole lines (tqdm's figures, no ``\\r`` frames, no escape codes); on a
terminal the same code draws a tqdm bar; ``enabled=False`` writes nothing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.progress import ProgressBar
from tests.unit.sdk_fake import FakeServer
from tests.unit.test_sdk_extract import make_prepared


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def assert_line_based(text: str, desc: str, n_lines_min: int) -> list[str]:
    assert "\r" not in text and "\x1b" not in text, repr(text[:300])
    lines = [line for line in text.splitlines() if line.startswith(f"{desc}:")]
    assert len(lines) >= n_lines_min, text
    return lines


def test_bar_on_a_terminal_lines_in_a_log_nothing_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL_S", "0")
    log, tty, off = io.StringIO(), Terminal(), io.StringIO()
    for stream, enabled in ((log, None), (tty, None), (off, False)):
        with ProgressBar("verify", 4, unit="shard", stream=stream, enabled=enabled) as bar:
            for _ in range(4):
                bar.update(1)
    lines = assert_line_based(log.getvalue(), "verify", 4)  # one per update (interval 0); close repeats none
    assert lines[-1].startswith("verify: 100%") and "4/4" in lines[-1] and "shard/s" in lines[-1]
    assert "\r" in tty.getvalue() and "4/4" in tty.getvalue()  # tqdm redraws in place on a terminal
    assert off.getvalue() == ""


def test_lines_are_periodic_not_per_update(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL_S", "3600")
    log = io.StringIO()
    with ProgressBar("train", 1000, unit="step", initial=200, stream=log) as bar:
        for _ in range(800):
            bar.update(1)
    (line,) = assert_line_based(log.getvalue(), "train", 1)  # only the final line within an hour
    assert "1000/1000" in line


def test_extract_progress_in_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL_S", "0")
    rows = make_prepared(tmp_path / "prepared")
    server = FakeServer()
    extract_dataset(tmp_path / "prepared", tmp_path / "out", "http://a", config=ExtractConfig(progress=None),
                    transport=server.transport(), sleep=lambda s: None)  # fmt: skip
    lines = assert_line_based(capsys.readouterr().err, "extract", len(rows))
    total = sum(len(r.input_ids) for r in rows)
    assert lines[-1].startswith("extract: 100%") and f"samples={len(rows)}/{len(rows)}" in lines[-1]
    assert "tok/s" in lines[-1] and "MB/s" in lines[-1] and str(total) in lines[-1]


@pytest.mark.integration
def test_prepare_progress_in_a_log(
    tmp_path: Path, smollm2_tokenizer: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EAGLE3_PROGRESS_INTERVAL_S", "0")
    src = tmp_path / "in.jsonl"
    turns = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(70)]  # fmt: skip
    rows = [{"messages": t} for t in turns]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dataset(
        str(src), tmp_path / "out", model=DEFAULT_MODEL, config=PrepareConfig(), tokenizer=smollm2_tokenizer
    )
    lines = assert_line_based(capsys.readouterr().err, "prepare", 70)
    assert lines[-1].startswith("prepare: 70row") and "kept=70" in lines[-1]
