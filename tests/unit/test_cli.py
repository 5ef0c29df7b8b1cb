"""The eagle3 console script: options, exit codes and messages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eagle3.cli import main
from eagle3.core.models import DEFAULT_MODEL


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unknown_option_exits_nonzero_and_names_it(capsys, tmp_path):
    code, _, err = run(capsys, "prepare", "--data-path", "x.jsonl", "--out", str(tmp_path))
    assert code == 2
    assert "unrecognized option: '--data-path'" in err
    assert "eagle3 prepare: error" in err


def test_misspelled_option_gets_a_suggestion(capsys, tmp_path):
    code, _, err = run(capsys, "prepare", "--input", "x", "--out", str(tmp_path), "--max-lenght=5")
    assert code == 2
    assert "'--max-lenght' (did you mean '--max-length'?)" in err


def test_abbreviations_are_not_accepted(capsys, tmp_path):
    code, _, err = run(capsys, "prepare", "--input", "x", "--out", str(tmp_path), "--max", "5")
    assert code == 2 and "'--max'" in err


def test_unknown_command(capsys):
    code, _, err = run(capsys, "extrakt")
    assert code == 2 and "invalid choice: 'extrakt'" in err


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_numbers_are_rejected(capsys, tmp_path, value):
    code, _, err = run(capsys, "vocab", "--prepared", str(tmp_path), "--draft-vocab-size", value)
    assert code == 2 and "--draft-vocab-size" in err


def test_missing_input_file_is_a_clear_error(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "prepare",
        "--input",
        str(tmp_path / "missing.jsonl"),
        "--out",
        str(tmp_path / "o"),
        "--model",
        DEFAULT_MODEL,
    )
    assert code == 1
    assert f"eagle3 prepare: error: input '{tmp_path / 'missing.jsonl'}' does not exist" in err


def test_vocab_on_a_directory_that_was_never_prepared(capsys, tmp_path):
    code, _, err = run(capsys, "vocab", "--prepared", str(tmp_path))
    assert code == 1 and "is not a prepared directory (run eagle3 prepare)" in err


def test_missing_chat_template_file(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "prepare",
        "--input",
        "builtin:chatterbot",
        "--out",
        str(tmp_path),
        "--chat-template",
        str(tmp_path / "t.jinja"),
        "--model",
        DEFAULT_MODEL,
    )
    assert code == 1 and "--chat-template" in err and "does not exist" in err


def test_console_script_is_installed_and_exits_nonzero_on_a_bad_option():
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3", "prepare", "--data-path", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "'--data-path'" in proc.stderr
