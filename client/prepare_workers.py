"""The CPU-heavy half of prepare (parse, render, tokenize), in this process or in a worker pool.

Rendering chat templates is pure Python (jinja) and holds the GIL, so parallelism needs processes.
Workers are spawned (not forked: a forked Rust tokenizer can deadlock), each loads the tokenizer once,
and rows travel in chunks. At most ``2 * workers`` chunks are in flight and results come back in
input order, so memory stays bounded and the output is identical to a single-process run.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import islice

from eagle3.core.conversations import RawRow, RowError, parse_row
from eagle3.core.errors import Eagle3Error
from eagle3.core.masking import ChatTokenizer, Tokenized

CHUNK_ROWS = 64


class WorkerError(Eagle3Error, RuntimeError):
    """A worker process died (failed to start, was killed); the run cannot go on."""


_WORKER_CHAT: ChatTokenizer | None = None  # set once per worker process by _init_worker


@dataclass(frozen=True)
class RowResult:
    """One row after tokenization: ``tokens`` or, for a malformed row, ``error``."""

    location: str
    key: str
    tokens: Tokenized | None
    error: str | None = None
    source_id: str | None = None


def tokenize_row(raw: RawRow, chat: ChatTokenizer) -> RowResult:
    """Parse and tokenize one row; a malformed row becomes an ``error`` (template errors raise)."""
    try:
        if raw.error is not None:
            raise RowError(raw.error)
        conversation = parse_row(raw.row or {}, raw.location)
        tokens = chat.tokenize(conversation.messages)
    except RowError as exc:
        return RowResult(raw.location, raw.key, None, str(exc))
    return RowResult(raw.location, raw.key, tokens, None, conversation.source_id)


def tokenize_rows(
    rows: Iterable[RawRow],
    chat: ChatTokenizer,
    *,
    workers: int = 1,
    model_dir: str = "",
    trust_remote_code: bool = False,
) -> Iterator[RowResult]:
    """``tokenize_row`` over ``rows``, in order; ``workers > 1`` uses that many processes, each
    loading the tokenizer from ``model_dir`` with ``chat``'s template."""
    if workers <= 1:
        for raw in rows:
            yield tokenize_row(raw, chat)
        return
    # NOTE: concurrent.futures, not multiprocessing.Pool: a Pool silently respawns workers that die
    # (at start-up, or killed for memory) and waits forever; the executor raises BrokenProcessPool.
    with ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(model_dir, chat.chat_template, trust_remote_code),
    ) as pool:
        pending: deque[Future[list[RowResult]]] = deque()
        iterator = iter(rows)
        try:
            while chunk := list(islice(iterator, CHUNK_ROWS)):
                pending.append(pool.submit(_tokenize_chunk, chunk))
                if len(pending) >= 2 * workers:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        except BrokenProcessPool as exc:
            raise WorkerError(
                f"a tokenizing worker process died ({exc}); run with --workers 1 to see the cause in-process"
            ) from exc
        finally:
            for future in pending:
                future.cancel()


def _init_worker(model_dir: str, chat_template: str | None, trust_remote_code: bool = False) -> None:
    from transformers import AutoTokenizer

    global _WORKER_CHAT
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    _WORKER_CHAT = ChatTokenizer(tokenizer, chat_template)


def _tokenize_chunk(chunk: list[RawRow]) -> list[RowResult]:
    assert _WORKER_CHAT is not None, "worker not initialized"
    return [tokenize_row(raw, _WORKER_CHAT) for raw in chunk]
