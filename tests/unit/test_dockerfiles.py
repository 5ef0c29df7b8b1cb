"""The images' facts, read from the Dockerfiles (Docker cannot run here): pinned bases that agree
with the project's own pins, a non-root user, a HEALTHCHECK on /livez at the port the server is told
to use, torch and vLLM never reinstalled over the base, a build context holding what the COPYs need
and nothing else; and hadolint passes on both files."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "docker" / "server.Dockerfile"
CPU = ROOT / "docker" / "cpu.Dockerfile"
CONSTRAINTS = ROOT / "docker" / "cpu-constraints.txt"
HADOLINT = Path(sys.executable).parent / "hadolint"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    lineno: int


def instructions(path: Path) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comment lines dropped."""
    out: list[Instruction] = []
    pending, start = "", 0
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        pending = ""
    return out


def only(path: Path, keyword: str) -> Instruction:
    found = [i for i in instructions(path) if i.keyword == keyword]
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {len(found)}"
    return found[0]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extra_pin(extra: str, name: str) -> str:
    for line in pyproject()["project"]["optional-dependencies"][extra]:
        req = Requirement(line)
        if canonicalize_name(req.name) == name:
            (spec,) = req.specifier
            assert spec.operator == "==", f"pyproject extra {extra}: {name} must be pinned with =="
            return spec.version
    raise AssertionError(f"pyproject extra {extra} has no {name}")


def makefile_torch() -> str:
    match = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile: TORCH_SPEC ?= torch==X not found"
    return match.group(1)


def pip_installs(path: Path) -> list[list[str]]:
    """Argument lists of every `pip install` inside the RUN instructions."""
    out = []
    for run in (i for i in instructions(path) if i.keyword == "RUN"):
        commands: list[list[str]] = [[]]
        for word in shlex.split(run.args):
            if word in ("&&", "||", ";"):
                commands.append([])
            else:
                commands[-1].append(word)
        for words in commands:
            if ("pip" in words or "-m" in words) and "install" in words and any(w.endswith("pip") for w in words):
                out.append(words[words.index("install") + 1 :])
    return out


@pytest.mark.parametrize("path", [SERVER, CPU], ids=lambda p: p.name)
def test_base_image_is_pinned(path):
    image = only(path, "FROM").args.split()[0]
    name, _, tag = image.partition(":")
    assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{path.name}: base {image} is not pinned"


def test_server_base_is_the_tested_vllm():
    assert only(SERVER, "FROM").args.split()[0] == f"vllm/vllm-openai:v{extra_pin('vllm', 'vllm')}"


def test_server_image_keeps_the_base_torch_and_vllm():
    installs = pip_installs(SERVER)
    assert installs, "server.Dockerfile installs eagle3 with pip"
    for args in installs:
        named = {canonicalize_name(Requirement(a).name) for a in args if not a.startswith(("-", ".", "/"))}
        assert not named & {"torch", "vllm"}, f"server.Dockerfile reinstalls {named & {'torch', 'vllm'}}"
        assert "--constraint" in args or "-c" in args, "pip in the server image is constrained to the base's versions"
    assert "pip list --format=freeze" in " ".join(i.args for i in instructions(SERVER) if i.keyword == "RUN")


def test_cpu_image_pins_the_makefile_torch_from_the_cpu_index():
    torch = makefile_torch()
    first, *rest = pip_installs(CPU)
    assert f"torch=={torch}" in first and "https://download.pytorch.org/whl/cpu" in first
    assert f"torch=={torch}\n" in CONSTRAINTS.read_text()
    for args in rest:  # later installs are constrained (torch included) or take no dependencies
        assert "--constraint" in args or "--no-deps" in args, args


def load_freezer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("freeze_constraints", ROOT / "docker" / "freeze_constraints.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_constraints_pin_every_dependency():
    """A dependency added to pyproject without re-running docker/freeze_constraints.py fails here."""
    freezer = load_freezer()
    needed = set(freezer.closure(freezer.ROOT, freezer.EXTRAS))
    pinned = {
        canonicalize_name(Requirement(line).name)
        for line in CONSTRAINTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert needed, "the closure of eagle3[server,train,data] is not empty"
    assert not needed - pinned, f"not pinned in docker/cpu-constraints.txt: {sorted(needed - pinned)}"


@pytest.mark.parametrize("path", [SERVER, CPU], ids=lambda p: p.name)
def test_runs_as_non_root(path):
    steps = instructions(path)
    users = [i for i in steps if i.keyword == "USER"]
    assert users, f"{path.name}: no USER (runs as root)"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), f"{path.name}: USER {user}"
    assert max(i.lineno for i in steps if i.keyword == "RUN") < users[-1].lineno, "nothing runs as root after USER"
    runs = " ".join(i.args for i in steps if i.keyword == "RUN")
    assert re.search(rf"useradd .*--uid {user} ", runs), f"{path.name}: USER {user} is not the user created"


def test_server_healthcheck_is_liveness_on_the_served_port():
    health = only(SERVER, "HEALTHCHECK").args
    cmd = json.loads(only(SERVER, "CMD").args)
    port = cmd[cmd.index("--port") + 1]
    assert f"127.0.0.1:{port}/livez" in health, "HEALTHCHECK probes /livez (readiness would fail during the load)"
    assert "/readyz" not in health
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert only(SERVER, "EXPOSE").args == port


def dockerignore_includes(patterns: list[str], path: str) -> bool:
    """.dockerignore semantics for the allowlist form used here: last matching pattern wins."""
    included = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern[1:] if negated else pattern
        body = body.rstrip("/")
        matches = (
            body == "*"
            or path == body
            or path.startswith(body + "/")
            or (body.startswith("**/") and body[3:] in path.split("/"))
        )
        if matches:
            included = negated
    return included


def test_build_context_is_an_allowlist_covering_every_copy():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()]
    patterns = [p for p in patterns if not p.startswith("#")]
    for path in (SERVER, CPU):
        for copy in (i for i in instructions(path) if i.keyword == "COPY"):
            *sources, _dest = copy.args.split()
            for source in (s for s in sources if not s.startswith("--")):
                assert (ROOT / source).exists(), f"{path.name}:{copy.lineno}: COPY {source} does not exist"
                assert dockerignore_includes(patterns, source), f"{path.name}: COPY {source} is excluded"
    for heavy in (".venv", ".git", "demo_out", "tests", "eagle3/__pycache__"):
        assert not dockerignore_includes(patterns, heavy), f".dockerignore lets {heavy} into the build context"


def run_hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("hadolint") or str(HADOLINT)
    return subprocess.run([exe, "--no-color", *map(str, paths)], capture_output=True, text=True, timeout=60)


def test_hadolint_passes():
    result = run_hadolint(SERVER, CPU)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_an_unpinned_image(tmp_path):
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    result = run_hadolint(bad)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3013" in result.stdout
