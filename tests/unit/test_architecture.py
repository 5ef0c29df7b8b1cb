"""The layering of docs/architecture.md, checked on the source with ast and in fresh interpreters.

    eagle3 (console: cli, demo, local_server, train)
      ├── eagle3.client         ─┐
      ├── eagle3.server          ├── siblings: none imports another
      └── eagle3.draft_trainer  ─┘
            └── eagle3.core       imports nothing of ours; eagle3.core.protocol: stdlib only
                                  (and eagle3.core.errors, the error root, itself stdlib only)

A notebook that installs only the SDK must never pull torch, fastapi or the server in.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIBLINGS = ("client", "server", "draft_trainer")
CONSOLE_MODULES = {"eagle3.cli", "eagle3.demo", "eagle3.local_server", "eagle3.train", "eagle3.__main__"}


def imported_modules(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Absolute module names ``path`` imports (relative imports are not used in this repository);
    with ``top_level_only``, only the imports that run when the module is imported (not in functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    nodes = _module_level(tree) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if node.module == "eagle3")
    return names


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """Statements executed at import: the module body, descending into if/try/with but not defs or classes,
    and leaving out ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return out


def top(name: str) -> str:
    return name.split(".")[0]


def ours(name: str) -> str | None:
    """The layer of one of our modules (``core``, ``client``, ``server``, ``draft_trainer``, ``console``),
    or None for a third-party or stdlib module."""
    if name == "eagle3" or name in CONSOLE_MODULES:
        return "console"
    parts = name.split(".")
    if parts[0] == "eagle3" and len(parts) > 1:
        return parts[1] if parts[1] in ("core", *SIBLINGS) else "console"
    if parts[0] in ("core", *SIBLINGS):  # the old top-level names must not come back
        return f"bare:{parts[0]}"
    return None


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", sources("core"), ids=_ids)
def test_core_imports_nothing_of_ours_and_no_torch_at_import(path):
    names = imported_modules(path)
    assert {ours(n) for n in names} <= {None, "core"}, sorted(n for n in names if ours(n) not in (None, "core"))
    heavy = {"torch", "transformers", "fastapi", "uvicorn", "vllm", "httpx"}
    assert not {top(n) for n in imported_modules(path, top_level_only=True)} & heavy


ERROR_ROOT = "eagle3.core.errors"  # the one root of the error tree; the protocol's errors derive from it


@pytest.mark.parametrize("path", [*sources("core/protocol"), ROOT / "core" / "errors.py"], ids=_ids)
def test_protocol_is_stdlib_only(path):
    """The protocol stands on the stdlib and on the error root, which stands on the stdlib alone."""
    allowed_ours = ERROR_ROOT if path.parent.name == "protocol" else None
    for name in imported_modules(path):
        assert (
            top(name) in sys.stdlib_module_names
            or name.startswith("eagle3.core.protocol")
            or name == "__future__"
            or name == allowed_ours
        ), name


@pytest.mark.parametrize("path", [p for pkg in SIBLINGS for p in sources(pkg)], ids=_ids)
def test_siblings_stand_only_on_core(path):
    """client, server and draft_trainer import the core and themselves, never each other or the console."""
    package = path.relative_to(ROOT).parts[0]
    layers = {layer for n in imported_modules(path) if (layer := ours(n)) is not None}
    assert layers <= {"core", package}, f"{package} imports {sorted(layers - {'core', package})}"


@pytest.mark.parametrize("path", sources("client"), ids=_ids)
def test_client_never_imports_torch_fastapi_or_server(path):
    banned = {"torch", "fastapi", "uvicorn", "vllm"}
    names = imported_modules(path)
    assert not {top(n) for n in names} & banned
    assert not {ours(n) for n in names} & {"server", "draft_trainer", "console"}


@pytest.mark.parametrize("path", sources("draft_trainer"), ids=_ids)
def test_trainer_never_imports_server(path):
    assert "server" not in {ours(n) for n in imported_modules(path)}


@pytest.mark.parametrize("path", sources("server"), ids=_ids)
def test_server_never_imports_trainer(path):
    assert "draft_trainer" not in {ours(n) for n in imported_modules(path)}


@pytest.mark.parametrize("path", sources("server/backends"), ids=_ids)
def test_backends_import_no_sdk_module(path):
    assert "client" not in {ours(n) for n in imported_modules(path)}


@pytest.mark.parametrize("path", sources("server/backends"), ids=_ids)
def test_backends_never_import_the_server(path):
    """A backend is an engine adapter: it imports the core and its sibling backends, never the server's
    routes, scheduler, runtime or settings (the server drives backends, not the other way round)."""
    server = [n for n in imported_modules(path) if ours(n) == "server" and not n.startswith("eagle3.server.backends")]
    assert not server, server


def test_the_engines_do_not_import_each_other():
    """What the hf and vllm backends share (the dtype table, the checkpoint identity) lives in shared
    backend modules (dtypes.py, identity.py, base.py), not in one engine's module."""
    vllm_modules = sorted((ROOT / "server" / "backends").glob("vllm*.py"))
    assert vllm_modules
    for path in vllm_modules:
        assert "eagle3.server.backends.hf" not in imported_modules(path), path.name
    assert not {n for n in imported_modules(ROOT / "server" / "backends" / "hf.py") if ".backends.vllm" in n}


@pytest.mark.parametrize(
    "path",
    [p for pkg in ("core", *SIBLINGS, "eagle3") for p in sources(pkg)],
    ids=_ids,
)
def test_only_the_vllm_backend_imports_vllm(path):
    """vllm is imported only by the vllm backend's modules and the trainer's vLLM evaluation and its engine
    child (each lazily imported by its caller), so the hf server, the SDK and training never need it."""
    vllm_modules = path.parent == ROOT / "server" / "backends" and path.name.startswith("vllm")
    evaluation = {ROOT / "draft_trainer" / name for name in ("evaluate_vllm.py", "vllm_engine.py")}
    if not vllm_modules and path not in evaluation:
        assert "vllm" not in {top(n) for n in imported_modules(path)}


def test_guard_sees_imports():
    """The checks above would catch a violation (guards against an always-empty import set or a layer
    function that maps everything to None)."""
    names = imported_modules(ROOT / "client" / "prepare.py")
    assert {"eagle3.core.protocol", "eagle3.core.models", "json"} <= names
    assert [ours(n) for n in ("eagle3.server.app", "eagle3.cli", "client" + ".sdk", "json")] == [
        "server",
        "console",
        "bare:client",
        None,
    ]
    lazy = imported_modules(ROOT / "core" / "models.py")
    assert "torch" in {top(n) for n in lazy} - {
        top(n) for n in imported_modules(ROOT / "core" / "models.py", top_level_only=True)
    }


def _clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH (the vllm backend exports the checkout's root there for its
    engine processes; a fresh interpreter here must see only what is installed)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _loaded_after(statement: str) -> list[str]:
    """Run ``statement`` in a fresh interpreter outside the checkout; return every module it loaded."""
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=_clean_env()
    )
    return proc.stdout.split()


def test_protocol_import_loads_no_other_package_of_ours():
    baseline = set(_loaded_after("pass"))  # site hooks (editable-install finder, distutils hack)
    loaded = [
        m
        for m in _loaded_after("import eagle3.core.protocol.frames, eagle3.core.protocol.features")
        if m not in baseline
    ]
    ours_loaded = [m for m in loaded if m == "eagle3" or m.startswith("eagle3.")]
    assert all(
        m in ("eagle3", "eagle3.core", "eagle3.core.lazy", ERROR_ROOT) or m.startswith("eagle3.core.protocol")
        for m in ours_loaded
    ), ours_loaded
    assert all(top(m) in sys.stdlib_module_names or m.startswith("eagle3") for m in loaded), [
        m for m in loaded if top(m) not in sys.stdlib_module_names and not m.startswith("eagle3")
    ]


def test_core_modules_load_no_torch():
    modules = [f"eagle3.core.{p.stem}" for p in sorted((ROOT / "core").glob("*.py")) if p.stem != "__init__"]
    loaded = _loaded_after("import " + ", ".join(modules))
    assert not {"torch", "transformers", "fastapi", "vllm"} & set(loaded)


def test_cli_and_sdk_import_without_torch_or_transformers():
    """At run time too: the console script and the SDK load no heavy module until a step needs it."""
    loaded = _loaded_after(
        "import eagle3.cli, eagle3.client, eagle3.client.sdk, eagle3.client.prepare, eagle3.draft_trainer.vocab; "
        "from eagle3 import ExtractionClient"
    )
    assert not {"torch", "transformers", "fastapi", "datasets"} & set(loaded)
    sdk = _loaded_after("from eagle3 import ExtractionClient, extract_dataset")
    assert not [m for m in sdk if ours(m) in ("server", "draft_trainer", "console") and m != "eagle3"]


def test_installed_names_live_under_one_namespace():
    """A user's own client.py or server.py cannot shadow ours: nothing is importable as bare
    ``client``/``server``/``core`` from outside the checkout."""
    loaded = _loaded_after("import eagle3.client.sdk, eagle3.server, eagle3.draft_trainer, eagle3.core")
    assert not {"client", "server", "core", "draft_trainer"} & set(loaded)
    proc = subprocess.run(
        [sys.executable, "-c", "import client"], capture_output=True, text=True, cwd="/", check=False, env=_clean_env()
    )
    assert proc.returncode != 0 and "No module named 'client'" in proc.stderr
