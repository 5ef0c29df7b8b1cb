"""What the scheduler keeps per admitted request, and the small types around it (server/scheduler.py).

A ``Request`` is one admitted call: its units still to run (``pending``), its finished ``Result``s waiting
for the stream (``results``, bounded by ``request_buffer_tokens``), its reservation and how much of it has
been given back. ``FunctionEngine`` builds an ``Engine`` from plain functions; ``AdmissionError`` is a
refusal before any work (429 / 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic

from typing_extensions import TypeVar

from eagle3.core.errors import Eagle3Error
from eagle3.server.backends.base import GenerationRun, WholeGeneration
from eagle3.server.lanes import BULK
from eagle3.server.units import Unit

if TYPE_CHECKING:
    from eagle3.server.generation import GenerateWork

ExtractFn = Callable[[Sequence[Sequence[int]]], Sequence[Any]]
GenerateFn = Callable[["GenerateWork"], Any]  # a whole generate request -> its replies (one slice)
GENERATE_SLICE_TOKENS = 16  # new tokens per prompt in one slice of a generate request


def request_buffer_tokens(max_batch_tokens: int, bytes_per_token: int, max_buffer_bytes: int) -> int:
    """Per-request output buffer in tokens: ``2 * max_batch_tokens`` (double buffering), at most
    ``max_buffer_bytes`` of states, but never less than one full forward pass (else a request alone
    could never fill a pass)."""
    by_bytes = max_buffer_bytes // max(1, bytes_per_token)
    return max(max_batch_tokens, min(2 * max_batch_tokens, by_bytes))


class FunctionEngine:
    """An ``Engine`` from plain functions (tests, embedding): ``generate`` runs a request in one slice."""

    def __init__(self, extract: ExtractFn, generate: GenerateFn | None = None) -> None:
        self._extract, self._generate = extract, generate
        self.generate_slice_tokens = GENERATE_SLICE_TOKENS

    def extract(self, batch: Sequence[Sequence[int]]) -> Sequence[Any]:
        return self._extract(batch)

    def start_generation(self, work: GenerateWork) -> GenerationRun:
        generate = self._generate
        if generate is None:
            raise RuntimeError("this scheduler was built without a generate function")
        return WholeGeneration(lambda: generate(work))


class AdmissionError(Eagle3Error):
    """Refused before any work: maps to an HTTP error (429 rate_limited, 503 unavailable)."""

    def __init__(self, status: int, type_: str, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status, self.type, self.reason, self.retry_after_s = status, type_, reason, retry_after_s


U = TypeVar("U", bound=Unit, default=Any)  # a bare ``Result`` is any unit's


@dataclass
class Result(Generic[U]):
    """One unit's outcome, for its request's reader: ``states`` is the unit's output (a ``Sample``'s
    tensor ``[n_tokens, L+1, H]``, a generate unit's replies) on success, else ``error``."""

    sample: U
    states: Any = None
    error: dict[str, Any] | None = None  # {type, message, retryable} on failure


@dataclass(eq=False)
class Request:
    request_id: str
    tenant: str
    samples: Sequence[Unit]
    lock: threading.Lock
    loop: asyncio.AbstractEventLoop
    pending: deque[Unit] = field(default_factory=deque)  # not yet handed to the backend
    results: deque[Result[Any]] = field(default_factory=deque)  # finished, not yet taken by the stream
    outstanding_tokens: int = 0  # running or buffered (the output queue's fill)
    released_tokens: int = 0
    closed: bool = False
    abort_error: dict[str, Any] | None = None  # set by abort_all: the stream ends with ERROR
    event: asyncio.Event = field(default_factory=asyncio.Event)
    admitted_at: float = field(default_factory=time.monotonic)  # for the latency histograms
    first_scheduled: bool = False
    lane: str = BULK  # server/lanes.py
    use_cache: bool = True  # the request's "cache": "use" (else "bypass")

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.samples)

    def notify(self) -> None:
        # The stream's loop may be gone (shutdown, or closed between a check and the call): nobody waits.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.event.set)

    def take_results(self) -> list[Result[Any]]:
        """Everything finished so far, without waiting (possibly nothing)."""
        with self.lock:
            out = list(self.results)
            self.results.clear()
        return out

    async def next_results(self, timeout_s: float) -> list[Result[Any]]:
        """Everything finished so far; waits up to ``timeout_s`` when nothing is (an empty list then)."""
        with self.lock:
            ready = bool(self.results) or self.abort_error is not None
            if not ready:
                self.event.clear()
        if not ready:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout_s)
        with self.lock:
            out = list(self.results)
            self.results.clear()
        return out
