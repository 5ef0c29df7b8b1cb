"""``eagle3 serve`` settings: one typed definition (server/config.py) -> flags, EAGLE3_* variables and
--config, with flag > variable > file > default, and one-line errors naming the source."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from eagle3.core.knobs import config_key, env_name, flag_name, knob_fields
from eagle3.server.cli import add_serve_command, settings_from_args
from eagle3.server.config import ServerSettings, SettingsError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_serve_command(sub)
    return parser.parse_args(["serve", "--backend", "hf", "--model", "SmolLM2-135M-Instruct", *argv])


def settings(argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    return settings_from_args(parse(argv), env or {})


def test_every_setting_has_a_flag_a_variable_and_help():
    fields = knob_fields(ServerSettings)
    assert len(fields) >= 25
    names = [f.name for f in dataclasses.fields(ServerSettings)]
    assert [f.name for f in fields] == [n for n in names if n not in ("api_keys", "api_keys_text", "sources")]
    for f in fields:
        assert f.metadata["knob"].help, f.name
        assert env_name(f) == "EAGLE3_" + flag_name(f)[2:].replace("-", "_").upper()
    help_text = parse([]).func.__name__  # the command is wired
    assert help_text == "run_serve"


def test_defaults_stated_once():
    s = settings([])
    assert s.max_batch_tokens == ServerSettings.max_batch_tokens == 8192
    assert s.max_body_bytes == 64 << 20 and s.request_buffer_bytes == 256 << 20
    assert s.tensor_parallel_size == 1 and s.api_keys == {}


def test_precedence_flag_over_env_over_config_over_default(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-batch-tokens: 1024\nmax_inflight_tokens: 99999\nmax-body-mb: 3\nheartbeat_s: 2.5\n")
    env = {"EAGLE3_MAX_BATCH_TOKENS": "2048", "EAGLE3_HEARTBEAT_S": "4"}
    s = settings(["--config", str(cfg), "--heartbeat-s", "7"], env)
    assert s.max_batch_tokens == 2048  # env over file
    assert s.max_inflight_tokens == 99999  # file over default
    assert s.max_body_bytes == 3 << 20  # MiB in the file, as the flag
    assert settings(["--max-payload-mb", "0.5"]).max_payload_bytes == 1 << 19  # fractions of a MiB
    assert s.heartbeat_s == 7.0  # flag over env over file
    assert settings(["--config", str(cfg)]).max_batch_tokens == 1024
    as_json = tmp_path / "serve.json"
    as_json.write_text(json.dumps({"max_batch_tokens": 512}))
    assert settings(["--config", str(as_json)]).max_batch_tokens == 512


def test_env_config_path_and_booleans_and_lists():
    env = {"EAGLE3_VLLM_COMPILE": "true", "EAGLE3_AUX_LAYER_IDS": "1,4,7", "EAGLE3_API_KEY": "k1, k2"}
    s = settings([], env)
    assert s.vllm_compile is True and s.vllm_options.compile is True
    assert s.aux_layer_ids == (1, 4, 7)
    assert s.api_keys == {"k1": "key-1", "k2": "key-2"}
    assert "k1" not in repr(s)  # keys never printed with the settings
    assert settings(["--no-vllm-compile"], env).vllm_compile is False


def test_engine_args_typed_and_merged():
    s = settings(
        ["--engine-args-json", '{"enable_expert_parallel": true, "max_num_seqs": 8}', "--engine-arg",
         "max_num_seqs=64", "--engine-arg", "quantization=fp8"]
    )  # fmt: skip
    assert s.vllm_options.engine_args == {"enable_expert_parallel": True, "max_num_seqs": 64, "quantization": "fp8"}
    with pytest.raises(SettingsError, match="KEY=VALUE"):
        settings(["--engine-arg", "no-equals-sign"])
    with pytest.raises(SettingsError, match="JSON object"):
        settings(["--engine-args-json", "[1]"])


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"EAGLE3_MAX_BATCH_TOKENS": "lots"}, "EAGLE3_MAX_BATCH_TOKENS 'lots'"),
        ([], {"EAGLE3_MAX_BATCH_TOKENS": "-5"}, "--max-batch-tokens must be positive"),
        ([], {"EAGLE3_PORT": "eighty"}, "EAGLE3_PORT 'eighty'"),
        ([], {"EAGLE3_AUX_LAYER_IDS": "2,x"}, "EAGLE3_AUX_LAYER_IDS '2,x': expected comma-separated integers"),
        ([], {"EAGLE3_DEFAULT_CODEC": "gzip"}, "choose one of"),
        ([], {"EAGLE3_API_KEY": "secret-key", "EAGLE3_MAX_BODY_MB": "x"}, "EAGLE3_MAX_BODY_MB 'x'"),
    ],
)
def test_bad_values_name_their_source(argv, env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace("+", r"\+")):
        settings(argv, env)


def test_bad_flag_value_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--max-batch-tokens", "lots"])
    assert "--max-batch-tokens: invalid int value: 'lots'" in capsys.readouterr().err


def test_config_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-batch-tokens: [1\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        settings(["--config", str(bad)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("max-batch-size: 8\n")
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) \['max_batch_size'\]"):
        settings(["--config", str(unknown)])
    with pytest.raises(SettingsError, match="cannot read"):
        settings(["--config", str(tmp_path / "missing.yaml")])
    assert {config_key(f) for f in knob_fields(ServerSettings)} >= {"max_body_mb", "api_keys_file", "engine_arg"}
