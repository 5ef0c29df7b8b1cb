"""One config loader for ``serve --config`` and ``train --config`` (core/config_files.py): the same
formats by extension (YAML, JSON, TOML), errors that name the file, the line and the right format,
and dotted ``--set`` overrides; serve's settings remember where each value came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.cli import build_parser
from eagle3.core.config_files import ConfigFileError, parse_set_items, read_config_file
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.errors import ConfigError
from eagle3.server.cli import settings_from_args
from eagle3.server.config import ServerSettings, SettingsError

SAME = {
    ".yaml": "max_batch_tokens: 4096\nlr: 0.002\n",
    ".yml": "max-batch-tokens: 4096\nlr: 2.0e-3\n",
    ".json": '{"max_batch_tokens": 4096, "lr": 0.002}',
    ".toml": "max_batch_tokens = 4096\nlr = 0.002\n",
}


def serve_settings(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    args = build_parser().parse_args(["serve", "--backend", "hf", "--model", "SmolLM2-135M-Instruct", *argv])
    return settings_from_args(args, env if env is not None else {"HOME": str(tmp_path)})


@pytest.mark.parametrize("suffix", sorted(SAME))
def test_serve_and_train_read_the_same_formats(tmp_path: Path, suffix: str) -> None:
    train_file = tmp_path / f"train{suffix}"
    train_file.write_text(SAME[suffix])
    assert read_config_file(train_file) == {"max_batch_tokens": 4096, "lr": 0.002}
    cfg = load_config(train_file)
    assert (cfg.max_batch_tokens, cfg.lr) == (4096, 0.002)
    serve_file = tmp_path / f"serve{suffix}"
    serve_file.write_text(SAME[suffix].replace("lr", "link_mb_s"))
    settings = serve_settings(tmp_path, ["--config", str(serve_file)])
    assert (settings.max_batch_tokens, settings.link_mb_s) == (4096, 0.002)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("x.yaml", "a: [1\n", r"x\.yaml:2: not valid YAML"),
        ("x.toml", "a = \n", r"x\.toml: not valid TOML: .*line 1"),
        ("x.json", '{"a": 1,\n "b": }', r"x\.json:2: not valid JSON: Expecting value \(column 7\)"),
        ("x.ini", "[a]\n", r"x\.ini: unknown config format '\.ini'; name the file \.yaml/\.yml \(YAML\), \.json"),
        ("x.toml", "lr = 1\n[[x]]\n", None),  # valid TOML: the error, if any, is not a format error
        ("x.yaml", "- 1\n- 2\n", r"x\.yaml: expected a mapping of settings \(key: value\) at the top, got a list"),
    ],
)
def test_errors_name_the_file_the_line_and_the_right_format(
    tmp_path: Path, name: str, text: str, expected: str | None
) -> None:
    path = tmp_path / name
    path.write_text(text)
    if expected is None:
        assert read_config_file(path)["lr"] == 1
        return
    with pytest.raises(ConfigFileError, match=expected):
        read_config_file(path)
    with pytest.raises(ConfigError, match="--config .*" + expected):  # train
        load_config(path)
    with pytest.raises(SettingsError, match="--config .*" + expected):  # serve
        serve_settings(tmp_path, ["--config", str(path)])


def test_the_issues_two_dialect_errors_are_gone(tmp_path: Path) -> None:
    """train --config x.yaml was parsed as JSON ("not valid yaml (Expecting value ...)") and serve --config
    x.toml as YAML ("expected a mapping of settings, got str")."""
    yaml_file = tmp_path / "x.yaml"
    yaml_file.write_text("ttt_steps: 3\nfeatures: f\n")
    assert load_config(yaml_file).ttt_steps == 3
    toml_file = tmp_path / "x.toml"
    toml_file.write_text('max_batch_tokens = 1024\nhost = "127.0.0.1"\n')
    assert serve_settings(tmp_path, ["--config", str(toml_file)]).max_batch_tokens == 1024


def test_dotted_overrides_reach_into_mappings() -> None:
    assert parse_set_items(["lr=2e-4", "engine_args.max_num_seqs=8", "engine-args.kv-cache-dtype=fp8"]) == {
        "lr": "2e-4",
        "engine_args": {"max_num_seqs": "8", "kv_cache_dtype": "fp8"},
    }
    with pytest.raises(ConfigFileError, match="KEY=VALUE"):
        parse_set_items(["lr"])
    with pytest.raises(ConfigFileError, match="lr is a value, not a mapping"):
        parse_set_items(["lr=1", "lr.x=2"])


def test_serve_takes_engine_args_from_the_file_and_set_and_names_the_sources(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_batch_tokens: 1024\nlink_mb_s: 10\nengine_args:\n  max_num_seqs: 4\n  quantization: fp8\n")
    env = {"EAGLE3_MAX_BATCH_TOKENS": "2048", "EAGLE3_LINK_MB_S": "20"}
    s = serve_settings(
        tmp_path,
        [
            "--config",
            str(config),
            "--set",
            "engine_args.max_num_seqs=8",
            "--set",
            "link_mb_s=30",
            "--set",
            "max_batch_tokens=999",
            "--max-batch-tokens",
            "512",
        ],
        env,
    )
    assert s.vllm_options.engine_args == {"max_num_seqs": 8, "quantization": "fp8"}  # --set over the file's 4
    assert s.max_batch_tokens == 512 and s.link_mb_s == 30.0  # flag > --set > variable > file
    assert s.sources["max_batch_tokens"] == "--max-batch-tokens"
    assert s.sources["link_mb_s"] == "--set link_mb_s"
    assert s.sources["engine_arg"] == "--set engine_arg"
    only_file = serve_settings(tmp_path, ["--config", str(config)], {"EAGLE3_LINK_MB_S": "20"})
    assert only_file.sources["max_batch_tokens"] == "--config max_batch_tokens"
    assert only_file.sources["link_mb_s"] == "EAGLE3_LINK_MB_S" and only_file.link_mb_s == 20.0
    effective = only_file.effective()
    assert effective["max_batch_tokens"] == "1024 (--config max_batch_tokens)" and "heartbeat_s" not in effective
    with pytest.raises(SettingsError, match="engine_args: expected a mapping"):
        serve_settings(tmp_path, ["--set", "engine_args=8"])


def test_secrets_are_not_shown_in_the_effective_settings(tmp_path: Path) -> None:
    s = serve_settings(tmp_path, ["--api-key", "sekrit-1"])
    assert "sekrit" not in repr(s.effective()) and s.effective()["api_key"] == "*** (--api-key)"
    assert s.effective()["api_keys"] == "1 tenant(s)"


def test_train_overrides_still_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.yml"
    path.write_text("lr: 0.01\nttt_steps: 3\n")
    assert load_config(path, {"ttt_steps": "5"}).ttt_steps == 5
    with pytest.raises(ConfigError, match="unknown config key 'optimizer.lr'"):
        load_config(None, {"optimizer.lr": "1"})


def test_the_model_cache_variable_no_longer_turns_the_feature_cache_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLE3_CACHE_DIR is the model cache's root (the images set it); the feature cache's disk tier is
    --feature-cache-dir / EAGLE3_FEATURE_CACHE_DIR. Before the split the variable meant both."""
    from eagle3.core.models import cache_dir

    model_cache = {"EAGLE3_CACHE_DIR": str(tmp_path / "models")}
    s = serve_settings(tmp_path, [], model_cache)
    assert s.cache_dir is None and "cache_dir" not in s.sources
    features = serve_settings(tmp_path, [], {**model_cache, "EAGLE3_FEATURE_CACHE_DIR": str(tmp_path / "f")})
    assert features.cache_dir == str(tmp_path / "f") and features.sources["cache_dir"] == "EAGLE3_FEATURE_CACHE_DIR"
    assert serve_settings(tmp_path, ["--feature-cache-dir", "/x"]).cache_dir == "/x"
    config = tmp_path / "serve.toml"
    config.write_text('feature_cache_dir = "/y"\n')
    assert serve_settings(tmp_path, ["--config", str(config)]).cache_dir == "/y"
    with pytest.raises(SettingsError, match=r"--cache-dir is now --feature-cache-dir \(\$EAGLE3_FEATURE_CACHE_DIR\)"):
        serve_settings(tmp_path, ["--cache-dir", "/z"])
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"  # the model cache still follows it
