"""Import boundaries (DESIGN.md §2), checked on the source with ast: a notebook that installs only
the SDK must never pull torch, fastapi or the server in."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", sources("client"), ids=lambda p: str(p.relative_to(ROOT)))
def test_client_never_imports_torch_fastapi_or_server(path):
    banned = {"torch", "fastapi", "uvicorn", "server", "draft_trainer", "vllm"}
    assert not {top(n) for n in imported_modules(path)} & banned


@pytest.mark.parametrize("path", sources("client/protocol"), ids=lambda p: str(p.relative_to(ROOT)))
def test_protocol_is_stdlib_only(path):
    for name in imported_modules(path):
        assert top(name) in sys.stdlib_module_names or name.startswith("client.protocol") or name == "__future__", name


@pytest.mark.parametrize("path", sources("draft_trainer"), ids=lambda p: str(p.relative_to(ROOT)))
def test_trainer_never_imports_server(path):
    assert "server" not in {top(n) for n in imported_modules(path)}


@pytest.mark.parametrize(
    "path",
    [p for pkg in ("client", "server", "draft_trainer", "eagle3") for p in sources(pkg)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_only_the_vllm_backend_imports_vllm(path):
    """vllm is imported only by the vllm backend's modules and the trainer's vLLM evaluation (each lazily
    imported by its caller), so the hf server, the SDK and training never need it."""
    vllm_modules = path.parent == ROOT / "server" / "backends" and path.name.startswith("vllm")
    if not vllm_modules and path != ROOT / "draft_trainer" / "evaluate_vllm.py":
        assert "vllm" not in {top(n) for n in imported_modules(path)}


def test_guard_sees_imports():
    """The checks above would catch a violation (guards against an always-empty import set)."""
    names = imported_modules(ROOT / "client" / "prepare.py")
    assert {"client.protocol", "eagle3.models", "json"} <= names


def test_cli_and_sdk_import_without_torch_or_transformers():
    """At run time too: the console script and the SDK load no heavy module until a step needs it."""
    code = (
        "import sys, eagle3.cli, client, client.prepare, draft_trainer.vocab; "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert proc.stdout.strip() == "[]"
