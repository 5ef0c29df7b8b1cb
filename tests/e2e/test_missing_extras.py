"""A command whose extra is not installed ends with one line naming ``pip install 'eagle3[EXTRA]'``, not
a ``ModuleNotFoundError`` traceback. Each case runs the console in a fresh interpreter whose import
system refuses the extra's modules (a meta-path finder raising ModuleNotFoundError, as a missing
package does), so the dev environment's own packages cannot hide the failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import missing_extra

REPO_ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
from eagle3.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_without(blocked: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, blocked, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        check=False,
    )


@pytest.mark.parametrize(
    ("blocked", "argv", "extra"),
    [
        ("uvicorn", ["serve", "--backend", "synthetic", "--port", "0"], "server"),
        ("fastapi", ["serve", "--backend", "synthetic", "--port", "0"], "server"),
        ("torch", ["train", "--features", "f", "--vocab", "v", "--model", "m", "--out", "o"], "train"),
        ("torch", ["export", "run", "--out", "x"], "train"),
        ("vllm", ["serve", "--backend", "vllm", "--model", "dummy:tiny", "--port", "0"], "vllm"),
    ],
)
def test_a_missing_extra_is_named(tmp_path: Path, blocked: str, argv: list[str], extra: str) -> None:
    proc = run_without(blocked, argv, tmp_path)
    err = proc.stderr
    assert proc.returncode in (1, 2), err
    assert "Traceback" not in err and "ModuleNotFoundError" not in err, err
    assert f"pip install 'eagle3[{extra}]'" in err.strip().splitlines()[-1], err


def test_the_help_needs_no_extra(tmp_path: Path) -> None:
    proc = run_without("torch,fastapi,uvicorn,vllm,transformers", ["serve", "--help"], tmp_path)
    assert proc.returncode == 0 and "--feature-cache-dir" in proc.stdout, proc.stderr


def test_modules_of_no_extra_keep_their_traceback() -> None:
    assert missing_extra("serve", "httpx") is None  # a base dependency: the install itself is broken
    assert missing_extra("serve", "eagle3.server.nothing") is None
    assert missing_extra("demo", "torch.cuda") == "this command needs 'torch', which is not installed: " + (
        "pip install 'eagle3[server,train]'"
    )
