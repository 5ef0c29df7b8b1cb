"""Read conversations from the common dataset shapes into one normalized form.

Accepted row shapes (one JSON object per JSONL line, or one row of a ``datasets`` dataset):

* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str | parts}]}``
  (``parts`` is a list of ``{"type": "text", "text": ...}``; other part types are rejected);
* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}``;
* a prompt/response pair: ``{"prompt": str, "response": str}`` (``completion`` is accepted for
  ``response``), with an optional ``"system": str``.

Any row may carry an ``"id"``; it is kept as provenance. Sources are streamed: a JSONL file (plain
or ``.gz``), a ``datasets`` dataset saved with ``save_to_disk``, or ``builtin:chatterbot`` (the
English dialogs of the ``chatterbot-corpus`` package, BSD-3-Clause). Every row comes with a
location string (``path:line``) so that errors name exactly where the bad row is.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
}
BUILTIN_CHATTERBOT = "builtin:chatterbot"


class RowError(Eagle3Error, ValueError):
    """One input row is malformed; the message says why (the caller adds where)."""


class SourceError(Eagle3Error, ValueError):
    """The input itself cannot be read (missing file, unknown format, missing package)."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Conversation:
    location: str  # "path:line" of the input row
    messages: tuple[Message, ...]
    source_id: str | None = None


@dataclass(frozen=True)
class RawRow:
    """A row as read, before parsing; ``error`` is set when it could not even be decoded."""

    location: str  # human-readable, for messages: "path:line"
    key: str  # unique and stable within the source: becomes the sample id
    row: dict[str, Any] | None
    error: str | None = None


def parse_row(row: dict[str, Any], location: str) -> Conversation:
    """Normalize one row of any accepted shape. Raises ``RowError`` on a malformed row."""
    source_id = str(row["id"]) if row.get("id") is not None else None
    if "messages" in row:
        messages = _parse_messages(row["messages"], "messages", role_key="role", text_key="content")
    elif "conversations" in row:
        messages = _parse_sharegpt(row["conversations"])
    elif "prompt" in row:
        messages = _parse_pair(row)
    else:
        keys = ", ".join(sorted(row)) or "none"
        raise RowError(
            f"unrecognized row shape (keys: {keys}); expected 'messages', 'conversations' or 'prompt' + 'response'"
        )
    if not any(m.role == "assistant" for m in messages):
        raise RowError("conversation has no assistant turn")
    return Conversation(location, tuple(messages), source_id)


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RowError(f"{where}: only text content parts are supported, got {part!r:.80}")
            texts.append(part["text"])
        return "".join(texts)
    raise RowError(f"{where}: content must be a string, got {type(value).__name__}")


def _parse_messages(value: Any, field: str, *, role_key: str, text_key: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RowError(f"'{field}' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RowError(f"{field}[{i}] must be an object")
        role = item.get(role_key)
        if role not in ROLES:
            raise RowError(f"{field}[{i}].{role_key} is {role!r}; expected one of {', '.join(ROLES)}")
        if text_key not in item or item[text_key] is None:
            raise RowError(f"{field}[{i}] has no '{text_key}'")
        out.append(Message(role, _text(item[text_key], f"{field}[{i}].{text_key}")))
    return out


def _parse_sharegpt(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RowError("'conversations' must be a non-empty list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RowError(f"conversations[{i}] must be an object")
        if "from" not in item and "role" in item:  # some ShareGPT dumps use role/content
            speaker, text = item.get("role"), item.get("content")
        else:
            speaker, text = item.get("from"), item.get("value")
        role = _SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise RowError(f"conversations[{i}].from is {speaker!r}; expected human/gpt/system")
        if text is None:
            raise RowError(f"conversations[{i}] has no 'value'")
        out.append(Message(role, _text(text, f"conversations[{i}].value")))
    return out


def _parse_pair(row: dict[str, Any]) -> list[Message]:
    response = row.get("response", row.get("completion"))
    if response is None:
        raise RowError("row has 'prompt' but no 'response'")
    messages = []
    if row.get("system") is not None:
        messages.append(Message("system", _text(row["system"], "system")))
    messages.append(Message("user", _text(row["prompt"], "prompt")))
    messages.append(Message("assistant", _text(response, "response")))
    return messages


def iter_rows(source: str, *, split: str = "train") -> Iterator[RawRow]:
    """Stream the raw rows of ``source`` (a JSONL path, a saved dataset dir or a builtin name)."""
    if source == BUILTIN_CHATTERBOT:
        yield from _iter_chatterbot()
        return
    path = Path(source)
    if not path.exists():
        raise SourceError(f"input {source!r} does not exist")
    if path.is_dir():
        yield from _iter_saved_dataset(path, split)
        return
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from _iter_parquet(path)
    elif name.endswith((".json", ".json.gz")) and _starts_with_array(path):
        yield from _iter_json_array(path)
    elif name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")):
        yield from _iter_jsonl(path)
    else:
        raise SourceError(
            f"{path}: unknown input type {''.join(path.suffixes) or '(no extension)'!r}; prepare reads .jsonl / "
            ".jsonl.gz (one JSON object a line), .json (a JSON array of objects, or JSON lines), .parquet, a "
            "directory saved with datasets' save_to_disk, or builtin:chatterbot"
        )


def _starts_with_array(path: Path) -> bool:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _iter_json_array(path: Path) -> Iterator[RawRow]:
    """A whole-file JSON array (``[{...}, {...}]``), rows numbered from 1 as ``row<N>``."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for index, obj in enumerate(data, start=1):
        location, key = f"{path}[{index - 1}]", f"row{index}"
        if not isinstance(obj, dict):
            yield RawRow(location, key, None, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield RawRow(location, key, obj)


def _iter_parquet(path: Path) -> Iterator[RawRow]:
    """Row groups one batch at a time (a large file is never all in memory); needs pyarrow (eagle3[data])."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{path}: reading parquet needs pyarrow (pip install 'eagle3[data]')") from None
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 (pyarrow raises its own error types for a bad file)
        raise SourceError(f"{path}: not a readable parquet file ({exc})") from None
    index = 0
    for batch in reader.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            index += 1
            yield RawRow(f"{path}[{index - 1}]", f"row{index}", obj)


def _iter_jsonl(path: Path) -> Iterator[RawRow]:
    """Lines are read as bytes and decoded one by one, so a bad byte costs only its own line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        line_no = 0
        while True:
            try:
                data = fh.readline()
            except (EOFError, OSError, zlib.error) as exc:  # a truncated or corrupt .gz
                raise SourceError(f"{path}: cannot read past line {line_no} ({exc})") from exc
            if not data:
                return
            line_no += 1
            location, key = f"{path}:{line_no}", f"line{line_no}"
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRow(location, key, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield RawRow(location, key, None, f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(obj, dict):
                yield RawRow(location, key, None, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield RawRow(location, key, obj)


def _iter_saved_dataset(path: Path, split: str) -> Iterator[RawRow]:
    if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise SourceError(f"{path} is a directory but not a dataset saved with datasets' save_to_disk")
    try:
        import datasets
    except ImportError as exc:
        raise SourceError("reading a saved dataset needs the 'datasets' package: pip install datasets") from exc
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SourceError(f"{path} has splits {sorted(loaded)}; choose one with --split")
        loaded = loaded[split]
        label = f"{path}[{split}]"
    else:
        label = str(path)
    for i, row in enumerate(loaded):
        yield RawRow(f"{label} row {i}", f"row{i}", dict(row))


def _iter_chatterbot() -> Iterator[RawRow]:
    """The English chatterbot-corpus dialogs; each list alternates user / assistant statements."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "builtin:chatterbot needs the chatterbot-corpus package: "
            "pip install --no-deps chatterbot-corpus==1.3.3 pyyaml"
        )
    import yaml

    root = Path(next(iter(spec.submodule_search_locations))) / "data" / "english"
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for i, statements in enumerate(doc.get("conversations") or []):
            turns = [str(s) for s in statements if s is not None]
            if len(turns) % 2:  # a trailing user statement has no answer
                turns = turns[:-1]
            messages = [
                {"role": "user" if k % 2 == 0 else "assistant", "content": text} for k, text in enumerate(turns)
            ]
            location = f"chatterbot-corpus/english/{path.name} conversation {i}"
            yield RawRow(location, f"{path.stem}-{i}", {"id": f"{path.stem}-{i}", "messages": messages})
