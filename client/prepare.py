"""``eagle3 prepare``: conversations -> token ids + assistant loss mask, streamed to disk.

Data flow: ``conversations.iter_rows`` (one raw row at a time) -> ``parse_row`` (normalized
messages) -> ``ChatTokenizer.tokenize`` (render-boundary mask; in worker processes with
``workers > 1``, see ``prepare_workers``) -> length policy -> one line of ``samples.jsonl``, in input
order. Memory stays flat however large the input is.

Errors: a malformed row (bad JSON, unknown shape, a template that rejects it) is named by file and
line; ``on_error="fail"`` stops at the first one, ``"skip"`` counts it and goes on. Template
problems (no chat template, not prefix-stable, no assistant tokens) and out-of-range token ids are
always fatal: they would corrupt every sample, not one. The output appears under its final name
only when the run completes; a crash leaves ``samples.jsonl.partial`` with what was written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from eagle3.client.prepare_stats import MAX_EXAMPLES, PrepareStats
from eagle3.client.prepare_workers import RowResult, tokenize_rows
from eagle3.core.conversations import RawRow, iter_rows
from eagle3.core.errors import Eagle3Error
from eagle3.core.identity import model_config, tokenizer_sha256
from eagle3.core.masking import ChatTokenizer
from eagle3.core.models import resolve_model_dir
from eagle3.core.progress import ProgressBar
from eagle3.core.protocol import META_FILE, SAMPLES_FILE, STATS_FILE, PreparedMeta, PreparedSample
from eagle3.core.tokenizer_probe import TokenizerProbeError, probe_tokenizer

logger = logging.getLogger(__name__)


class PrepareError(Eagle3Error, RuntimeError):
    """prepare cannot go on: a malformed row under on_error=fail, a bad token id, a full disk."""


@dataclass(frozen=True)
class PrepareConfig:
    max_length: int | None = None  # tokens; None: the verifier's max_position_embeddings
    overlong: Literal["drop", "truncate"] = "drop"  # what to do with a sample over max_length
    limit: int | None = None  # read at most this many input rows (over all inputs)
    on_error: Literal["skip", "fail"] = "fail"  # malformed rows
    chat_template: str | None = None  # jinja text overriding the tokenizer's template
    split: str = "train"  # for a saved DatasetDict
    overwrite: bool = False
    workers: int = 1  # tokenizing processes; >1 pays ~4 s of start-up, worth it on large inputs
    progress: bool | None = None  # None: a bar on a terminal or in Jupyter, a log line every 30 s otherwise
    trust_remote_code: bool = False  # run the checkpoint's own tokenizer code (as serve --trust-remote-code)

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.overlong not in ("drop", "truncate"):
            raise ValueError(f"overlong must be 'drop' or 'truncate', got {self.overlong!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.on_error not in ("skip", "fail"):
            raise ValueError(f"on_error must be 'skip' or 'fail', got {self.on_error!r}")


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def prepare_dataset(
    source: str | Sequence[str],
    out_dir: str | Path,
    *,
    model: str,
    config: PrepareConfig | None = None,
    tokenizer: Any = None,
) -> PrepareStats:
    """Prepare ``source`` (one input or several) into ``out_dir``; returns the stats.

    ``model`` (the verifier whose tokenizer, vocabulary and context length apply) has no default:
    ``eagle3.core.models.resolve_model_dir`` accepts. With several inputs, sample ids are prefixed by
    the input's position (``"1/line7"``) so they stay unique.
    """
    config = config or PrepareConfig()
    sources = [source] if isinstance(source, str) else list(source)
    if not sources:
        raise PrepareError("no input given")
    out = Path(out_dir)
    if (out / SAMPLES_FILE).exists() and not config.overwrite:
        raise PrepareError(f"{out / SAMPLES_FILE} already exists; pass --overwrite to replace it")
    model_dir = resolve_model_dir(model)
    cfg = model_config(model_dir)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir, config.trust_remote_code)
    try:  # a tokenizer that loses text would make every sample wrong (core/tokenizer_probe.py)
        probe_tokenizer(tokenizer, model_dir)
    except TokenizerProbeError as exc:
        raise PrepareError(str(exc)) from None
    vocab_size = int(cfg.get("vocab_size") or len(tokenizer))
    context = int(cfg.get("max_position_embeddings") or 0) or None
    limits = [x for x in (config.max_length, context) if x]
    if not limits:
        raise PrepareError("the model config has no max_position_embeddings; pass --max-length")
    max_length = min(limits)
    if config.max_length and context and config.max_length > context:
        logger.warning("--max-length %d exceeds the model context %d; using %d", config.max_length, context, context)
    chat = ChatTokenizer(tokenizer, config.chat_template)

    out.mkdir(parents=True, exist_ok=True)
    partial = out / (SAMPLES_FILE + ".partial")
    stats = PrepareStats()
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            rows = _iter_all_rows(sources, config)
            with ProgressBar("prepare", config.limit, unit="row", enabled=config.progress) as bar:
                for result in tokenize_rows(
                    rows,
                    chat,
                    workers=config.workers,
                    model_dir=str(model_dir),
                    trust_remote_code=config.trust_remote_code,
                ):
                    stats.rows_read += 1
                    sample = _finish_row(result, config, stats, max_length, vocab_size)
                    if sample is not None:
                        fh.write(sample.to_json() + "\n")
                    if stats.rows_read % 64 == 0:
                        bar.set_postfix(kept=stats.kept, tokens=stats.total_tokens)
                    bar.update(1)
                bar.set_postfix(kept=stats.kept, tokens=stats.total_tokens)
            fh.flush()
            os.fsync(fh.fileno())
        if stats.kept == 0:
            raise PrepareError(f"no sample was kept from {', '.join(sources)}:\n{stats.format_text()}")
        meta = PreparedMeta(
            model=model,
            model_dir=str(model_dir),
            tokenizer_sha256=tokenizer_sha256(model_dir),
            chat_template_sha256=hashlib.sha256(str(chat.chat_template).encode()).hexdigest(),
            vocab_size=vocab_size,
            max_length=max_length,
            overlong=config.overlong,
            inputs=sources,
        )
        (out / META_FILE).write_text(meta.to_json())
        (out / STATS_FILE).write_text(json.dumps(stats.to_dict(), indent=2) + "\n")
        partial.replace(out / SAMPLES_FILE)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise PrepareError(
                f"disk full while writing {partial} after {stats.kept} samples; "
                "the samples written so far are kept there. Free space and re-run."
            ) from exc
        raise
    return stats


def _iter_all_rows(sources: list[str], config: PrepareConfig) -> Iterator[RawRow]:
    n_rows = 0
    for index, source in enumerate(sources):
        for raw in iter_rows(source, split=config.split):
            if config.limit is not None and n_rows >= config.limit:
                return
            n_rows += 1
            yield raw if len(sources) == 1 else replace(raw, key=f"{index}/{raw.key}")


def _finish_row(
    result: RowResult, config: PrepareConfig, stats: PrepareStats, max_length: int, vocab_size: int
) -> PreparedSample | None:
    """Apply the error and length policies to one tokenized row and count it."""
    if result.tokens is None:
        message = f"{result.location}: {result.error}"
        if config.on_error == "fail":
            raise PrepareError(f"malformed row at {message} (use --on-error skip to skip such rows)")
        if stats.dropped["malformed"] < MAX_EXAMPLES:
            logger.warning("skipping malformed row at %s", message)
        elif stats.dropped["malformed"] == MAX_EXAMPLES:
            logger.warning("more malformed rows: counted in stats.json, not logged")
        stats.drop("malformed", message)
        return None
    ids, mask = result.tokens.input_ids, result.tokens.loss_mask
    if len(ids) > max_length:
        if config.overlong == "drop":
            stats.drop("too_long")
            return None
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            stats.drop("no_assistant_tokens_after_truncation")
            return None
        stats.truncated += 1
    if (top := max(ids)) >= vocab_size:
        raise PrepareError(
            f"{result.location}: the tokenizer produced token id {top}, outside the model's "
            f"vocabulary of {vocab_size}; tokenizer and model do not match"
        )
    source = result.location if result.source_id is None else f"{result.location} (id={result.source_id})"
    stats.keep(len(ids), sum(mask))
    return PreparedSample(result.key, ids, mask, source)
