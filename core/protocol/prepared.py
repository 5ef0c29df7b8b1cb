"""A prepared dataset on disk: the output of ``eagle3 prepare``, the input of vocab and extract.

Layout of a prepared directory::

    samples.jsonl   one JSON object per line: {"id", "input_ids", "loss_mask", "source"}
    meta.json       PreparedMeta: schema version, model, tokenizer/template hashes, vocab size, limits
    stats.json      what prepare kept and dropped, token counts, length histogram

Invariants (checked by ``PreparedSample.__post_init__`` and ``iter_prepared``):

* ``len(input_ids) == len(loss_mask) >= 1``; every mask entry is 0 or 1; at least one entry is 1;
* ``0 <= input_ids[i] < meta.vocab_size`` (the verifier's embedding rows, not ``len(tokenizer)``);
* sample ids are unique within a directory (prepare derives them from the input position);
* an id ``<base>~s<k>`` (``variant_id``) is the ``k``-th extra reply to the prompt of sample ``<base>``
  (``eagle3 distill --sampled-replies``): training splits it with ``<base>`` so that no reply to a
  held-out prompt is trained on (draft_trainer/data.py ``split_role``);
* ``samples.jsonl`` appears under its final name only once prepare has finished; a crashed run
  leaves ``samples.jsonl.partial`` next to it, never a truncated ``samples.jsonl``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SAMPLES_FILE = "samples.jsonl"
META_FILE = "meta.json"
STATS_FILE = "stats.json"
VARIANT_MARK = "~s"
_VARIANT_RE = re.compile(r"(.+)~s([1-9][0-9]*)")


def variant_id(base: str, k: int) -> str:
    """The id of the ``k``-th (``k >= 1``) extra reply to the prompt of sample ``base``."""
    if k < 1:
        raise ValueError(f"variant numbers start at 1, got {k}")
    return f"{base}{VARIANT_MARK}{k}"


def variant_of(sample_id: str) -> tuple[str, int]:
    """``(base, k)`` of a ``variant_id``; ``(sample_id, 0)`` for any other id."""
    match = _VARIANT_RE.fullmatch(sample_id)
    return (match[1], int(match[2])) if match else (sample_id, 0)


class PreparedFormatError(ValueError):
    """A prepared directory is missing a file or holds a line that breaks the invariants."""


@dataclass(frozen=True)
class PreparedSample:
    """One tokenized conversation. ``loss_mask[i] == 1`` marks an assistant (supervised) token."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    source: str = ""  # where the row came from: "path:line" or "dataset[split] row i"

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise PreparedFormatError(f"sample {self.sample_id!r}: input_ids is empty")
        if len(self.input_ids) != len(self.loss_mask):
            raise PreparedFormatError(
                f"sample {self.sample_id!r}: {len(self.input_ids)} input_ids but "
                f"{len(self.loss_mask)} loss_mask entries"
            )
        values = set(self.loss_mask)
        if not values <= {0, 1}:
            raise PreparedFormatError(f"sample {self.sample_id!r}: loss_mask holds values other than 0/1")
        if 1 not in values:
            raise PreparedFormatError(f"sample {self.sample_id!r}: loss_mask has no assistant token")

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_assistant_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.sample_id,
                "input_ids": self.input_ids,
                "loss_mask": self.loss_mask,
                "source": self.source,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> PreparedSample:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise PreparedFormatError("line is not a JSON object")
        try:
            return cls(str(obj["id"]), list(obj["input_ids"]), list(obj["loss_mask"]), str(obj.get("source", "")))
        except KeyError as exc:
            raise PreparedFormatError(f"missing key {exc.args[0]!r}") from exc


@dataclass(frozen=True)
class PreparedMeta:
    """How a prepared directory was made; the extractor and trainer check it against the verifier."""

    model: str  # as given on the command line
    model_dir: str  # resolved local checkpoint
    tokenizer_sha256: str  # over the tokenizer files, so a different tokenizer is caught
    chat_template_sha256: str
    vocab_size: int  # the verifier's embedding rows (config.vocab_size)
    max_length: int  # longest sample kept, in tokens
    overlong: str  # "drop" | "truncate"
    inputs: list[str]  # as given: paths, saved-dataset dirs or builtin names
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> PreparedMeta:
        version = obj.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PreparedFormatError(
                f"prepared data has schema_version {version!r}; this eagle3 reads {SCHEMA_VERSION}. "
                "Re-run eagle3 prepare."
            )
        fields = {k: obj[k] for k in cls.__dataclass_fields__ if k in obj}
        try:
            return cls(**fields)
        except TypeError as exc:
            raise PreparedFormatError(f"meta.json is incomplete: {exc}") from exc


def read_meta(prepared_dir: str | Path) -> PreparedMeta:
    path = Path(prepared_dir) / META_FILE
    if not path.is_file():
        raise PreparedFormatError(f"{path} not found: {prepared_dir} is not a prepared directory (run eagle3 prepare)")
    try:
        return PreparedMeta.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise PreparedFormatError(f"{path}: not valid JSON ({exc})") from exc


def iter_prepared(prepared_dir: str | Path, *, vocab_size: int | None = None) -> Iterator[PreparedSample]:
    """Stream the samples of a prepared directory, one line at a time (constant memory).

    Raises ``PreparedFormatError`` naming the file and line of the first bad record, and on any
    token id outside ``[0, vocab_size)`` when ``vocab_size`` is given.
    """
    path = Path(prepared_dir) / SAMPLES_FILE
    if not path.is_file():
        partial = path.with_name(SAMPLES_FILE + ".partial")
        hint = f" ({partial.name} exists: that prepare run did not finish)" if partial.exists() else ""
        raise PreparedFormatError(f"{path} not found{hint}")
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                sample = PreparedSample.from_json(line)
            except (json.JSONDecodeError, PreparedFormatError, TypeError) as exc:
                raise PreparedFormatError(f"{path}:{line_no}: {exc}") from exc
            if vocab_size is not None and not (min(sample.input_ids) >= 0 and max(sample.input_ids) < vocab_size):
                bad = next(t for t in sample.input_ids if not 0 <= t < vocab_size)
                raise PreparedFormatError(
                    f"{path}:{line_no}: token id {bad} is outside the vocabulary [0, {vocab_size})"
                )
            yield sample
