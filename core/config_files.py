"""The one config-file reader of ``eagle3 serve --config`` and ``eagle3 train --config``, and the dotted
``KEY=VALUE`` overrides both take on the command line (``--set``).

Formats by extension, the same for every command: ``.yaml``/``.yml`` (YAML), ``.json`` (JSON),
``.toml`` (TOML). Any other extension is an error naming the three (a file is never parsed as a
format it was not named for, so an error always speaks of the right format). Errors name the file,
the line where the parser knows it, the format and what to do; the file must hold a mapping of
settings at the top.

Overrides: ``--set lr=2e-4`` sets a key; a dotted key reaches into a nested mapping as OmegaConf/Hydra
and vLLM's dotted flags (``--compilation-config.level``) do: ``--set engine_args.max_num_seqs=8`` sets
``{"engine_args": {"max_num_seqs": 8}}``. Values stay text (each command converts them to the
setting's type and names the key when that fails); a key's dashes read as underscores, as in files.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".toml": "TOML"}


class ConfigFileError(Eagle3Error, ValueError):
    """A config file cannot be read or parsed, or a ``--set`` item is malformed (one line: file, line, fix)."""


def config_format(path: Path) -> str:
    """``YAML``, ``JSON`` or ``TOML`` by the file's extension."""
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ConfigFileError(
            f"{path}: unknown config format {path.suffix or '(no extension)'!r}; "
            "name the file .yaml/.yml (YAML), .json (JSON) or .toml (TOML)"
        )
    return kind


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML, JSON or TOML file (by extension); dashes in its top-level keys read as
    underscores (``max-batch-tokens`` is ``max_batch_tokens``, as flags are written); nested mappings kept."""
    p = Path(path)
    kind = config_format(p)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigFileError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{p}: not a text file ({exc.reason} at byte {exc.start})") from None
    try:
        data = _parse(kind, text)
    except Exception as exc:  # noqa: BLE001 (json.JSONDecodeError, tomllib.TOMLDecodeError, any yaml.YAMLError)
        raise ConfigFileError(f"{p}{_line(exc)}: not valid {kind}: {_first_line(exc)}") from None
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{p}: expected a mapping of settings (key: value) at the top, got {_kind(data)}")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def _parse(kind: str, text: str) -> Any:
    if kind == "JSON":
        return json.loads(text)
    if kind == "TOML":
        return tomllib.loads(text)
    import yaml

    return yaml.safe_load(text)


def _line(exc: Exception) -> str:
    """``:LINE`` where the parser says (YAML's mark, JSON's lineno; TOML says it in its message)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f":{mark.line + 1}"
    lineno = getattr(exc, "lineno", None)
    return f":{lineno}" if isinstance(lineno, int) else ""


def _first_line(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} (column {exc.colno})"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}.get(
        type(value), type(value).__name__
    )


def parse_set_items(items: Iterable[str], flag: str = "--set") -> dict[str, Any]:
    """``["lr=2e-4", "engine_args.max_num_seqs=8"]`` -> ``{"lr": "2e-4", "engine_args": {"max_num_seqs": "8"}}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigFileError(f"{flag} expects KEY=VALUE (KEY may be dotted: a.b=1), got {item!r}")
        set_dotted(out, key.strip(), value, flag)
    return out


def set_dotted(mapping: dict[str, Any], key: str, value: Any, where: str = "--set") -> None:
    """``mapping[a][b] = value`` for ``key`` ``a.b`` (nested mappings made as needed)."""
    parts = [p.strip().replace("-", "_") for p in key.split(".")]
    if any(not p for p in parts):
        raise ConfigFileError(f"{where} {key!r}: empty name between dots")
    node = mapping
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigFileError(f"{where} {key!r}: {'.'.join(parts[: i + 1])} is a value, not a mapping")
        node = child
    node[parts[-1]] = value


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, nested mappings merged key by key (a ``--set a.b=1`` keeps the file's ``a.c``)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
