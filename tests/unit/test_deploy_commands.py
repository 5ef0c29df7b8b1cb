"""Every eagle3 command line written into the deployment files and docs/deploy.md is one the real
parser accepts: Dockerfile CMDs, compose commands, Kubernetes container args, torchrun launches and
the shell blocks of the docs. A misspelled or removed option fails here, not 20 minutes into a
verifier load. Serve commands are also turned into ``ServerSettings`` and train commands into a
``TrainConfig``, so values are checked too, not only option names."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3.cli import _reject_unknown_options, build_parser
from eagle3.draft_trainer.config import load_config, parse_overrides
from eagle3.server.cli import settings_from_args

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "deploy.md"
COMPOSE = ROOT / "docker" / "compose.yaml"
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
TRAINER_MODULE = "eagle3.train"
IMAGE_TOKEN = re.compile(r"^(\$REGISTRY/|registry\.example\.com/eagle3/|eagle3-)(server|cpu):")


@dataclass(frozen=True)
class Command:
    """One eagle3 invocation: ``argv`` as ``eagle3`` sees it; ``torchrun`` holds the launcher's own
    arguments (before ``-m eagle3.train``) when it is launched by torchrun."""

    source: str
    argv: tuple[str, ...]
    torchrun: tuple[str, ...] | None = None


def from_launch(source: str, words: list[str]) -> Command | None:
    """``eagle3 ...``, ``torchrun ... -m eagle3.train ...`` or ``docker run ... IMAGE ...``."""
    if not words:
        return None
    if words[0] == "eagle3":
        return Command(source, tuple(words[1:]))
    if words[0] == "torchrun":
        at = words.index(TRAINER_MODULE)
        assert words[at - 1] == "-m", f"{source}: torchrun must run -m {TRAINER_MODULE}"
        return Command(source, ("train", *words[at + 1 :]), tuple(words[1 : at - 1]))
    if words[:2] == ["docker", "run"]:
        image_at = next((i for i, w in enumerate(words) if IMAGE_TOKEN.match(w)), None)
        if image_at is not None and image_at + 1 < len(words):
            return Command(source, tuple(words[image_at + 1 :]))
    return None


def shell_lines(markdown: str) -> list[tuple[int, str]]:
    """Logical lines (continuations joined) of the ```sh blocks, with their first line number."""
    out: list[tuple[int, str]] = []
    in_block, pending, start = False, "", 0
    for lineno, line in enumerate(markdown.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_block = stripped == "```sh" if not in_block else False
            continue
        if not in_block:
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def doc_commands() -> list[Command]:
    commands = []
    for lineno, line in shell_lines(DOCS.read_text()):
        words = shlex.split(line, comments=True)
        command = from_launch(f"docs/deploy.md:{lineno}", words)
        if command is not None:
            commands.append(command)
    return commands


def compose_commands() -> list[Command]:
    compose = yaml.safe_load(COMPOSE.read_text())
    commands = []
    for name, service in compose["services"].items():
        entrypoint = [str(w) for w in service.get("entrypoint", ["eagle3"])]
        command = [str(w) for w in service["command"]]
        found = from_launch(f"docker/compose.yaml:{name}", entrypoint + command)
        assert found is not None, f"compose service {name}: not an eagle3 or torchrun command"
        commands.append(found)
    return commands


def k8s_containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            if pod is None:
                continue
            for container in pod.get("initContainers", []) + pod.get("containers", []):
                out.append((f"{path.relative_to(ROOT)}:{doc['metadata']['name']}/{container['name']}", container))
    return out


def k8s_commands() -> list[Command]:
    commands = []
    for source, container in k8s_containers():
        words = [str(w) for w in container.get("command", ["eagle3"]) + container.get("args", [])]
        found = from_launch(source, words)
        assert found is not None, f"{source}: not an eagle3 or torchrun command"
        commands.append(found)
    return commands


def dockerfile_commands() -> list[Command]:
    commands = []
    for path in DOCKERFILES:
        text = re.sub(r"\\\n", " ", path.read_text())
        found = {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^(ENTRYPOINT|CMD)\s+(\[.*\])$", text, re.M)}
        assert found.get("ENTRYPOINT") == ["eagle3"], f"{path.name}: ENTRYPOINT must be the eagle3 console script"
        commands.append(Command(f"docker/{path.name}:CMD", tuple(found["CMD"])))
    return commands


def all_commands() -> list[Command]:
    return doc_commands() + compose_commands() + k8s_commands() + dockerfile_commands()


def parse(command: Command) -> argparse.Namespace:
    """The real console-script parser, including its unknown-option check; SystemExit -> a failure."""
    parser = build_parser()
    argv = list(command.argv)
    try:
        _reject_unknown_options(parser, argv)
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{command.source}: `eagle3 {shlex.join(argv)}` is rejected by the parser (exit {exc.code})")


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.source)
def test_command_parses_with_the_real_cli(command):
    args = parse(command)
    if args.command == "serve":
        assert "--backend" in command.argv, "serve commands name their backend (auto differs per host)"
        # the keys file exists only inside the container: a command that names one gets a stand-in key (a
        # public --host without any key is refused, and must stay refused here)
        gives_keys = "--api-keys-file" in command.argv or "--api-key" in command.argv
        args.api_key, args.api_keys_file = (["stand-in-key"] if gives_keys else []), None
        settings = settings_from_args(args)
        assert settings.tensor_parallel_size is not None and settings.tensor_parallel_size >= 1
    if args.command == "train":
        cfg = load_config(args.config, parse_overrides(args.set))
        assert cfg.torch_threads >= 1


@pytest.mark.parametrize("command", [c for c in all_commands() if c.torchrun is not None], ids=lambda c: c.source)
def test_torchrun_options_parse_with_torchrun(command):
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args([*command.torchrun, "-m", TRAINER_MODULE, *command.argv[1:]])
    assert args.module and args.training_script == TRAINER_MODULE
    assert int(args.nproc_per_node) >= 1


def test_every_source_has_its_commands():
    """The collectors above find what is there (a parser change in them cannot silently test nothing)."""
    docs = {c.argv[0] for c in doc_commands()}
    assert docs >= {"serve", "prepare", "vocab", "extract", "train", "export"}
    assert {c.argv[0] for c in compose_commands()} == {"serve", "prepare", "vocab", "extract", "train", "export"}
    assert {c.argv[0] for c in k8s_commands()} == {"serve", "prepare", "vocab", "extract", "train", "export"}
    assert len(dockerfile_commands()) == len(DOCKERFILES) == 2
    assert any(c.torchrun for c in doc_commands()) and any(c.torchrun for c in k8s_commands())


def test_a_misspelled_option_is_caught():
    bad = Command("inline", ("serve", "--backend", "vllm", "--tensor-paralel-size", "8"))
    with pytest.raises(pytest.fail.Exception, match="rejected by the parser"):
        parse(bad)
    missing = Command("inline", ("extract", "--out", "/data/features", "/data/prepared"))  # no --server
    with pytest.raises(pytest.fail.Exception, match="rejected by the parser"):
        parse(missing)


def test_docs_reference_existing_files_and_names():
    text = DOCS.read_text()
    for path in set(re.findall(r"\b((?:docker|deploy/k8s)/[\w.-]+\.(?:Dockerfile|yaml|py|txt))\b", text)):
        assert (ROOT / path).is_file(), f"docs/deploy.md names {path}, which does not exist"
    services = set(yaml.safe_load(COMPOSE.read_text())["services"])
    for service in re.findall(r"docker compose -f docker/compose\.yaml (?:run --rm(?: -T --entrypoint \w+)?|up -d|"
                              r"stop) (\w+)", text):  # fmt: skip
        assert service in services, f"docs/deploy.md runs compose service {service!r}, not in docker/compose.yaml"
    jobs = {doc["metadata"]["name"] for p in K8S for doc in yaml.safe_load_all(p.read_text()) if doc["kind"] == "Job"}
    for job in re.findall(r"job/([\w-]+)", text):
        assert job in jobs, f"docs/deploy.md waits for job/{job}, not defined in deploy/k8s"


def test_the_documented_vllm_serve_command_uses_the_evals_speculative_config():
    """docs/deploy.md's `vllm serve ... --speculative-config` is what `eagle3 eval --engine vllm` measures."""
    from eagle3.draft_trainer.evaluate_vllm import _engine_request

    lines = [line for _, line in shell_lines(DOCS.read_text()) if line.startswith("vllm serve ") and
             "--speculative-config" in line]  # fmt: skip
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    documented = json.loads(words[words.index("--speculative-config") + 1])
    export_dir = documented["model"]
    built = _engine_request(Path("/models/verifier"), Path(export_dir), documented["num_speculative_tokens"],
                            "bfloat16", 4096, None, True)["speculative_config"]  # fmt: skip
    assert documented == built
    assert f"eagle3 export runs/draft --out {export_dir}" in DOCS.read_text()
