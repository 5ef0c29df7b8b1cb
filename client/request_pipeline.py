"""Several requests of one call in flight: the next ones stream while the caller consumes the current one.

A call's samples go in as many requests as the server's limits need (``split_requests``). Sent one after
the other, the server's scheduler has nothing of this caller to work on while the caller reads, decodes and
uses a request's samples, and the caller waits for a whole forward pass before each request's first sample.
With ``max_in_flight_requests`` N (``ExtractionClient`` / ``AsyncExtractionClient``, default 2) the next
N - 1 requests are already streaming (each on a thread of its own, or an asyncio task, over its own
connection of the client's pool) while the caller consumes one.

What does not change:

* **Order.** Outcomes come request by request in the call's order, each request's in arrival order, so
  ``ordered=True`` holds back nothing more than before and ``extract_stream`` is still exactly once.
* **Memory.** A request is started only once the caller has taken every outcome of the request N before
  it: at most N requests' samples are held (what one request holds is bounded by the server's
  ``max_request_tokens``).
* **Errors.** Each request retries on its own (``BatchAttempts``); a request's final error is raised after
  the last outcome of the requests before it, and the requests after it are stopped.
* **Leaving early** (``break``, ``close()``/``aclose()``, garbage collection) stops every request in flight:
  an asyncio task is cancelled at once; a thread stops at its next outcome (or read timeout, or before its
  next retry) and closes its response, so no request outlives the call by more than one sample.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class _Failed:
    """A request's exception, handed from its thread or task to the caller, raised there in order."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()  # a request's last outcome was handed over


def _handed(message: Any) -> bool:
    """True for an outcome to yield, False at the end of the request; raises the request's exception."""
    if isinstance(message, _Failed):
        raise message.exc
    return message is not _END


def _pump(
    stream: Callable[[threading.Event], Generator[Any, None, None]], out: queue.SimpleQueue[Any], stop: threading.Event
) -> None:
    outcomes = stream(stop)
    try:
        for item in outcomes:
            if stop.is_set():
                return
            out.put(item)
        out.put(_END)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there in order
        out.put(_Failed(exc))
    finally:
        outcomes.close()  # a request stopped early closes its response now, not at garbage collection


def pipelined(
    streams: Sequence[Callable[[threading.Event], Generator[T, None, None]]], max_in_flight: int
) -> Generator[T, None, None]:
    """The outcomes of ``streams`` (one per request, called with a stop event) in order, at most
    ``max_in_flight`` of them running at once, each on a daemon thread; ``max_in_flight`` 1 runs them
    one after the other on the caller's thread."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight_requests must be at least 1, got {max_in_flight}")
    stop = threading.Event()
    if max_in_flight == 1 or len(streams) <= 1:
        for stream in streams:
            yield from stream(stop)
        return
    pending = iter(streams)
    running: deque[tuple[queue.SimpleQueue[Any], threading.Thread]] = deque()

    def start_next() -> None:
        stream = next(pending, None)
        if stream is not None:
            out: queue.SimpleQueue[Any] = queue.SimpleQueue()
            thread = threading.Thread(target=_pump, args=(stream, out, stop), name="eagle3-request", daemon=True)
            thread.start()
            running.append((out, thread))

    try:
        for _ in range(max_in_flight):
            start_next()
        while running:
            out, _thread = running[0]
            while _handed(message := out.get()):
                yield message
            running.popleft()
            start_next()
    finally:
        stop.set()


async def apipelined(streams: Sequence[Callable[[], AsyncIterator[T]]], max_in_flight: int) -> AsyncGenerator[T, None]:
    """``pipelined`` for asyncio: each request is a task feeding its own queue; leaving early cancels them."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight_requests must be at least 1, got {max_in_flight}")
    if max_in_flight == 1 or len(streams) <= 1:
        for stream in streams:
            async for item in stream():
                yield item
        return
    pending = iter(streams)
    running: deque[tuple[asyncio.Queue[Any], asyncio.Task[None]]] = deque()

    async def pump(stream: Callable[[], AsyncIterator[Any]], out: asyncio.Queue[Any]) -> None:
        try:
            async for item in stream():
                out.put_nowait(item)
            out.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's task, in order
            out.put_nowait(_Failed(exc))

    def start_next() -> None:
        stream = next(pending, None)
        if stream is not None:
            out: asyncio.Queue[Any] = asyncio.Queue()
            running.append((out, asyncio.ensure_future(pump(stream, out))))

    try:
        for _ in range(max_in_flight):
            start_next()
        while running:
            out, _task = running[0]
            while _handed(message := await out.get()):
                yield message
            running.popleft()
            start_next()
    finally:
        tasks = [task for _, task in running]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
