"""A log (not a terminal) gets each progress line once and no ``\\r`` frames: the last plain line of a
bar is not printed twice (``make demo > log`` showed the final train/eval line twice), and the console
turns Hugging Face's own tqdm bars off when stderr is not a terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from eagle3.core.progress import ProgressBar

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_final_line_is_not_repeated_when_the_last_update_printed_it() -> None:
    log = io.StringIO()
    bar = ProgressBar("train", 3, unit="step", stream=log, interval_s=0.0)  # every update prints a line
    for _ in range(3):
        bar.set_postfix(loss="0.5")
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" [")[0] for line in lines] == ["train:  33% 1/3", "train:  67% 2/3", "train: 100% 3/3"], lines
    assert "\r" not in log.getvalue()


def test_the_final_line_comes_at_close_when_it_was_not_printed_yet() -> None:
    log = io.StringIO()
    bar = ProgressBar("eval", 5, unit="prompt", stream=log, interval_s=3600.0)
    for _ in range(5):
        bar.update(1)
    assert log.getvalue() == ""
    bar.close()
    bar.close()
    (line,) = log.getvalue().splitlines()
    assert "5/5" in line


CHECK = """
import sys
import eagle3.cli
import eagle3.draft_trainer.cli as trainer_cli

def run_vocab(args):
    from transformers.utils import logging
    print("hf bars", logging.is_progress_bar_enabled())
    return 0

trainer_cli.run_vocab = run_vocab
sys.exit(eagle3.cli.main(["vocab", "--prepared", ".", "--out", "v"]))
"""


def test_the_console_turns_hugging_face_bars_off_in_a_log(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=True
    )  # stderr is a pipe: a log, not a terminal
    assert "hf bars False" in proc.stdout, proc.stdout + proc.stderr
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "0"  # the operator's own setting wins
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=True
    )
    assert "hf bars True" in proc.stdout, proc.stdout + proc.stderr
