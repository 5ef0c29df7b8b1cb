"""One error root: every error class eagle3 defines derives from ``Eagle3Error`` (found by walking the
installed modules, not from a list), the console catches the root (so a new error needs no edit to
eagle3/cli.py to print one clean line), and the SDK's errors import from ``eagle3`` as openai-python's
do. The root is stdlib-only, so the protocol (stdlib-only) stands on it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

import pytest

import eagle3
import eagle3.cli
import eagle3.client.errors
import eagle3.draft_trainer.cli
from eagle3.core.errors import Eagle3Error

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = {"vllm"}  # a module needing one of these is checked where it is installed (the dev env has it)


def _all_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(eagle3.__path__, "eagle3.")]
    assert len(names) > 100, names  # the walk reached every package (core, client, server, draft_trainer)
    return names


def _error_classes() -> tuple[list[type[BaseException]], list[str]]:
    found: list[type[BaseException]] = []
    skipped: list[str] = []
    for name in _all_modules():
        if name == "eagle3.__main__":
            continue  # runs the console
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in OPTIONAL:
                skipped.append(name)
                continue
            raise
        for _, obj in inspect.getmembers(module, inspect.isclass):
            # warnings are no errors (client/request_samples.py's MaskMissingWarning is a UserWarning)
            if issubclass(obj, BaseException) and not issubclass(obj, Warning) and obj.__module__ == name:
                found.append(obj)
    return found, skipped


def test_every_error_class_eagle3_defines_derives_from_the_root():
    found, _skipped = _error_classes()
    names = {c.__qualname__ for c in found}
    # the walk saw the errors of every layer (the ones issue 28 named among them)
    assert {
        "ProtocolError",
        "PreparedFormatError",
        "FeaturesFormatError",
        "ModelNotFoundError",
        "TemplateError",
        "SourceError",
        "KnobError",
        "SettingsError",
        "TrainerError",
        "VocabError",
        "PrepareError",
        "WorkerError",
        "APIError",
        "BackendError",
    } <= names, sorted(names)
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, Eagle3Error))
    assert not outside, f"not under Eagle3Error: {outside}"


def test_errors_keep_the_stdlib_bases_callers_catch():
    from eagle3.client.prepare import PrepareError
    from eagle3.core.knobs import KnobError
    from eagle3.core.protocol.prepared import PreparedFormatError

    assert issubclass(KnobError, ValueError) and issubclass(PreparedFormatError, ValueError)
    assert issubclass(PrepareError, RuntimeError)


def test_the_root_is_stdlib_only_so_the_protocol_can_stand_on_it():
    tree = ast.parse((ROOT / "core" / "errors.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert all(m.split(".")[0] in sys.stdlib_module_names or m == "__future__" for m in imported), imported
    from eagle3.core.protocol.frames import ProtocolError

    assert issubclass(ProtocolError, Eagle3Error)


def test_the_sdk_errors_import_from_eagle3():
    tree = {
        name
        for name, obj in vars(eagle3.client.errors).items()
        if inspect.isclass(obj) and issubclass(obj, Eagle3Error)
    }
    assert len(tree) >= 18, tree
    assert tree <= set(eagle3.__all__), sorted(tree - set(eagle3.__all__))
    for name in tree:
        assert getattr(eagle3, name) is getattr(eagle3.client.errors, name)
    from eagle3 import APIError, RateLimitError
    from eagle3 import Eagle3Error as Root

    assert issubclass(RateLimitError, APIError) and issubclass(APIError, Root)


def test_a_new_error_raised_in_a_command_prints_one_clean_line(monkeypatch, capsys, tmp_path):
    """An error class the console has never heard of: one line, status 1, no traceback."""

    class BrandNewError(Eagle3Error):
        pass

    def run_vocab(args: object) -> int:
        raise BrandNewError("the thing at /x is wrong; pass --y to fix it")

    monkeypatch.setattr(eagle3.draft_trainer.cli, "run_vocab", run_vocab)
    code = eagle3.cli.main(["vocab", "--prepared", str(tmp_path), "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == "eagle3 vocab: error: the thing at /x is wrong; pass --y to fix it"
    assert "Traceback" not in err


def test_a_bug_still_shows_its_traceback(monkeypatch, tmp_path):
    def run_vocab(args: object) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(eagle3.draft_trainer.cli, "run_vocab", run_vocab)
    with pytest.raises(KeyError):
        eagle3.cli.main(["vocab", "--prepared", str(tmp_path), "--out", str(tmp_path / "v")])


@pytest.mark.parametrize("argv", [["-v", "vocab"], ["vocab", "-v"], ["vocab", "--verbose"]])
def test_verbose_is_accepted_before_or_after_the_subcommand(argv, tmp_path):
    args = eagle3.cli.build_parser().parse_args([*argv, "--prepared", str(tmp_path), "--out", str(tmp_path)])
    assert args.verbose is True
    quiet = eagle3.cli.build_parser().parse_args(["vocab", "--prepared", str(tmp_path), "--out", str(tmp_path)])
    assert quiet.verbose is False
