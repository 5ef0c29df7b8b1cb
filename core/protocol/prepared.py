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

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error

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


def is_heldout(sample_id: str, heldout_fraction: float) -> bool:
    """Whether the sample's prompt is held out: a hash of its id, of ``<base>`` for an extra reply. The
    one split rule of training, eval and self-instruct (draft_trainer/data.py states its invariants)."""
    digest = hashlib.sha256(variant_of(sample_id)[0].encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def variant_of(sample_id: str) -> tuple[str, int]:
    """``(base, k)`` of a ``variant_id``; ``(sample_id, 0)`` for any other id."""
    match = _VARIANT_RE.fullmatch(sample_id)
    return (match[1], int(match[2])) if match else (sample_id, 0)


class PreparedFormatError(Eagle3Error, ValueError):
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


def write_prepared(
    out_dir: str | Path, samples: Iterable[PreparedSample], meta: PreparedMeta, stats: dict[str, Any]
) -> int:
    """Write a prepared directory from ``samples``; returns how many. Crash-safe in this order: the
    samples go to ``samples.jsonl.partial`` (fsynced), then ``meta.json`` (``max_length`` set to the
    longest sample) and ``stats.json``, and only then is the partial file renamed. An older
    ``samples.jsonl`` is removed first, so a reader never sees samples with another run's meta. A repeated
    id raises ``PreparedFormatError`` naming it (and the partial file is removed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SAMPLES_FILE).unlink(missing_ok=True)
    partial, seen, longest = out / (SAMPLES_FILE + ".partial"), set(), 0
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            for sample in samples:
                if sample.sample_id in seen:
                    raise PreparedFormatError(f"{out}: sample id {sample.sample_id!r} appears twice")
                seen.add(sample.sample_id)
                longest = max(longest, sample.n_tokens)
                fh.write(sample.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    (out / META_FILE).write_text(dataclasses.replace(meta, max_length=max(longest, 1)).to_json())
    (out / STATS_FILE).write_text(json.dumps({"samples_kept": len(seen), **stats}, indent=2) + "\n")
    os.replace(partial, out / SAMPLES_FILE)
    return len(seen)


def concat_prepared(sources: list[str | Path], out_dir: str | Path) -> int:
    """One prepared directory holding every sample of ``sources`` in order (e.g. distilled chat replies
    plus self-instruct replies, to extract and train on together). The sources must share the tokenizer,
    chat template and vocabulary (else ``PreparedFormatError`` naming the two directories) and their ids
    must not collide."""
    metas = [read_meta(src) for src in sources]
    for src, meta in zip(sources[1:], metas[1:], strict=True):
        key, first = (meta.tokenizer_sha256, meta.chat_template_sha256, meta.vocab_size), metas[0]
        if key != (first.tokenizer_sha256, first.chat_template_sha256, first.vocab_size):
            raise PreparedFormatError(
                f"{src} was prepared with another tokenizer, chat template or vocabulary than {sources[0]} "
                f"({meta.model} against {first.model}): prepare both with the same --model"
            )
    merged = dataclasses.replace(metas[0], inputs=[i for m in metas for i in m.inputs])
    samples = (sample for src in sources for sample in iter_prepared(src))
    return write_prepared(out_dir, samples, merged, {"source": [str(s) for s in sources]})
