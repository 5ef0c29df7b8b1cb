"""``--model`` is required wherever a command loads the verifier: a forgotten ``--model`` is a usage error
(status 2) that says what to pass, never the 135M demo model in silence. ``eagle3 serve`` also takes it
from ``EAGLE3_MODEL`` or the ``--config`` key ``model``, and ``--backend synthetic`` needs none;
``eagle3 train`` takes it from its ``--config`` file too; ``eagle3 demo`` keeps its embedded default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import build_parser, main
from eagle3.core.cli_args import MissingModelError
from eagle3.core.models import DEFAULT_MODEL
from eagle3.core.protocol import read_meta
from eagle3.server.cli import SERVER_PROCESS_ENV
from eagle3.server.config import ServerSettings
from eagle3.server.runtime import Runtime

COMMANDS = {
    "prepare": ["prepare", "--input", "builtin:chatterbot", "--out", "{tmp}/prepared"],
    "serve": ["serve", "--backend", "hf"],
    "train": ["train", "--features", "{tmp}/features", "--vocab", "{tmp}/vocab", "--out", "{tmp}/run"],
    "eval": ["eval", "{tmp}/export", "--prepared", "{tmp}/prepared"],
}


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def no_model_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("EAGLE3_MODEL", "EAGLE3_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_without_model_is_a_usage_error_naming_what_to_pass(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model_env: pytest.MonkeyPatch
) -> None:
    argv = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    code, err = run(capsys, argv)
    assert code == 2, err
    assert f"usage: eagle3 {command}" in err
    assert f"eagle3 {command}: error: --model is required" in err
    for choice in ("local Hugging Face checkpoint directory", "org/name", "local Hugging Face cache", DEFAULT_MODEL):
        assert choice in err
    if command == "serve":
        assert "EAGLE3_MODEL" in err and "the key model of --config" in err
    if command == "train":
        assert "the key model of --config, or --set model=" in err
    assert list(tmp_path.iterdir()) == []  # nothing was written before the check


def test_demo_keeps_the_embedded_default() -> None:
    assert build_parser().parse_args(["demo"]).model == DEFAULT_MODEL
    assert build_parser().parse_args(["prepare", "--input", "x", "--out", "o"]).model is None


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ServerSettings]:
    """``eagle3 serve`` up to the point where it would start uvicorn: the settings it would serve."""
    import eagle3.server.serve

    got: list[ServerSettings] = []

    def serve(settings: ServerSettings) -> int:
        got.append(settings)
        return 0

    monkeypatch.setattr(eagle3.server.serve, "serve", serve)
    for name, value in SERVER_PROCESS_ENV.items():  # run_serve sets them; restored after
        monkeypatch.setenv(name, value)
    return got


def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


def test_serve_takes_the_model_from_the_variable_or_the_config_file(
    tmp_path: Path, served: list[ServerSettings], no_model_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from_env, from_file = checkpoint(tmp_path / "from-env"), checkpoint(tmp_path / "from-file")
    no_model_env.setenv("EAGLE3_MODEL", str(from_env))
    assert run(capsys, ["serve", "--backend", "hf"])[0] == 0
    assert served.pop().model == str(from_env)
    no_model_env.delenv("EAGLE3_MODEL")
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {from_file}\n")
    assert run(capsys, ["serve", "--backend", "hf", "--config", str(config)])[0] == 0
    assert served.pop().model == str(from_file)
    no_model_env.setenv("EAGLE3_MODEL", str(from_env))  # the variable wins over the file, the flag over both
    assert run(capsys, ["serve", "--backend", "hf", "--config", str(config)])[0] == 0
    assert served.pop().model == str(from_env)
    assert run(capsys, ["serve", "--backend", "hf", "--model", DEFAULT_MODEL])[0] == 0
    assert served.pop().model == DEFAULT_MODEL


def test_serve_synthetic_needs_no_model(
    served: list[ServerSettings], no_model_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, ["serve", "--backend", "synthetic"])[0] == 0
    (settings,) = served
    assert settings.model is None and settings.backend_model == DEFAULT_MODEL  # the embedded tokenizer


def test_a_runtime_that_loads_its_own_backend_needs_a_model() -> None:
    with pytest.raises(MissingModelError, match="--model is required"):
        Runtime(ServerSettings(backend="hf"))


def test_train_takes_the_model_from_its_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], smollm2_dir: Path
) -> None:
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"model": str(smollm2_dir)}))
    (tmp_path / "features").mkdir()
    code, err = run(capsys, ["train", "--features", str(tmp_path / "features"), "--vocab", "v",
                             "--out", str(tmp_path / "run"), "--config", str(config)])  # fmt: skip
    assert code == 1 and "--model is required" not in err  # past the check: the empty features dir is refused
    assert "not a features directory" in err


def test_prepare_with_an_org_name_from_the_local_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smollm2_dir: Path
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--acme--smol"
    snapshot = repo / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    for path in smollm2_dir.iterdir():  # config, tokenizer and chat template (prepare loads no weights)
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Hi", "response": "Hello!"}) + "\n")
    code, err = run(capsys, ["prepare", "--input", str(src), "--out", str(tmp_path / "out"), "--model", "acme/smol"])
    assert code == 0, err
    meta: Any = read_meta(tmp_path / "out")
    assert meta.model_dir == str(snapshot)
