"""One typed definition per setting, from which command-line flags, environment variables and a
config file are all derived (the way vLLM's ``EngineArgs`` and TGI's launcher do it).

A settings class is a frozen dataclass whose fields carry ``knob(...)`` metadata::

    @dataclass(frozen=True)
    class Settings:
        max_batch_tokens: int = knob(8192, "tokens per forward pass")

gives ``--max-batch-tokens`` (type int, the help with its default and variable) and
``EAGLE3_MAX_BATCH_TOKENS``. Precedence, highest first: a flag given on the command line, a ``--set
KEY=VALUE`` override, the environment variable, the ``--config`` file (YAML, JSON or TOML by extension,
``eagle3.core.config_files``; keys are field names or flag names), the field's default.
``__post_init__`` of the dataclass validates the result, whatever its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.config_files import ConfigFileError, merge, read_config_file
from eagle3.core.errors import Eagle3Error

ENV_PREFIX = "EAGLE3_"


class KnobError(Eagle3Error, ValueError):
    """A flag, variable or config entry has a bad value (a one-line CLI error naming its source)."""


@dataclass(frozen=True)
class Knob:
    help: str
    flag: str | None = None  # default: --field-name
    scale: float = 1  # stored value = given value * scale (e.g. 2**20 for a --...-mb flag of a bytes field)
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # text -> value, for types argparse cannot build
    repeat: bool = False  # a repeatable flag; its variable holds comma-separated values
    secret: bool = False  # never printed (help shows no default)
    metavar: str | None = None


def knob(default: Any, help: str, **options: Any) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable."""
    meta = {"knob": Knob(help=help, **options)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(f: dataclasses.Field[Any]) -> str:
    k: Knob = f.metadata["knob"]
    return k.flag or "--" + f.name.replace("_", "-")


def env_name(f: dataclasses.Field[Any]) -> str:
    return ENV_PREFIX + flag_name(f).lstrip("-").replace("-", "_").upper()


def config_key(f: dataclasses.Field[Any]) -> str:
    """The ``--config`` file key of a knob: its flag without the dashes, ``_`` for ``-``."""
    return flag_name(f).lstrip("-").replace("-", "_")


def knob_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "knob" in f.metadata]


def _base_type(cls: type, f: dataclasses.Field[Any]) -> type:
    """``int`` for ``int`` and ``int | None``; ``tuple`` for ``tuple[int, ...]``; and so on."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    return typing.get_origin(hint) or hint  # type: ignore[no-any-return]


def add_knob_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per knob field of ``cls``. Defaults stay out of the namespace (``SUPPRESS``) so that
    ``resolve`` can tell a flag given on the command line from one left to the lower sources."""
    for f in knob_fields(cls):
        k: Knob = f.metadata["knob"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        shown = "" if k.secret or default in (None, (), [], {}) else f"; default {_show(default, k)}"
        help_text = f"{k.help} (env {env_name(f)}{shown})"
        kind = _base_type(cls, f)
        common: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if kind is bool:
            parser.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, **common)
        elif k.repeat:
            parser.add_argument(flag_name(f), action="append", metavar=_metavar(f), **common)
        else:
            number = float if k.scale != 1 else kind  # a scaled flag (MiB of a bytes field) takes fractions
            kind_arg: dict[str, Any] = {"type": number} if kind in (int, float) and k.parse is None else {}
            parser.add_argument(
                flag_name(f), choices=k.choices, metavar=None if k.choices else _metavar(f), **kind_arg, **common
            )


def _metavar(f: dataclasses.Field[Any]) -> str:
    return f.metadata["knob"].metavar or flag_name(f).lstrip("-").split("-")[-1].upper()


def _show(value: Any, k: Knob) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool) and k.scale != 1:
        value = value / k.scale
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return str(value)


def load_config_file(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A YAML, JSON or TOML mapping of settings (by extension, ``eagle3.core.config_files``), with
    ``overrides`` (``parse_set_items`` of ``--set``) merged over it; keys are flag names without the
    dashes in front (``max-batch-tokens`` or ``max_batch_tokens``; ``max-body-mb`` in MiB like its flag)."""
    try:
        data = read_config_file(path)
    except ConfigFileError as exc:
        raise KnobError(f"--config {exc}") from None
    return merge(data, dict(overrides or {}))


def resolve(
    cls: type,
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
    sources: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Field values from the command line, the environment, a config file and the defaults, in that
    order of precedence; every value converted to its field's type (scaled where the knob says).
    ``sources``, when given, gets where each value came from (``--max-batch-tokens``,
    ``EAGLE3_MAX_BATCH_TOKENS``, ``--config max_batch_tokens``) for the start-up log."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in knob_fields(cls)}
    by_key = {config_key(f): f.name for f in fields.values()}
    unknown = sorted(set(config or {}) - set(by_key))
    if unknown:
        raise KnobError(f"--config: unknown setting(s) {unknown}; known: {sorted(by_key)}")
    config = {by_key[key]: value for key, value in (config or {}).items()}
    out: dict[str, Any] = {}
    for name, f in fields.items():
        k: Knob = f.metadata["knob"]
        if name in vars(args):
            raw, source = getattr(args, name), flag_name(f)
        elif env_name(f) in environ:
            text = environ[env_name(f)]
            raw, source = ([v.strip() for v in text.split(",") if v.strip()] if k.repeat else text), env_name(f)
        elif config and name in config:
            raw, source = config[name], f"--config {name}"
        else:
            continue
        out[name] = _convert(cls, f, raw, source)
        if sources is not None:
            sources[name] = source
    return out


def _convert(cls: type, f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    k: Knob = f.metadata["knob"]
    kind = _base_type(cls, f)
    try:
        if k.repeat:
            values = raw if isinstance(raw, list | tuple) else [raw]
            return tuple(k.parse(str(v)) if k.parse else str(v) for v in values)
        if raw is None:
            return None
        if k.parse is not None and isinstance(raw, str):
            return k.parse(raw)
        if kind is bool:
            return raw if isinstance(raw, bool) else _parse_bool(str(raw))
        if kind is tuple:
            items = raw if isinstance(raw, list | tuple) else str(raw).split(",")
            return tuple(int(x) for x in items)
        if kind is int:
            value = float(raw) * k.scale if k.scale != 1 else int(str(raw))
            return int(value)
        if kind is float:
            return float(raw) * k.scale
        text = str(raw)
        if k.choices and text not in k.choices:
            raise ValueError(f"choose one of {', '.join(k.choices)}")
        return text
    except (TypeError, ValueError) as exc:
        shown = "***" if k.secret else repr(raw)
        raise KnobError(f"{source} {shown}: {exc}") from None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true/false")
