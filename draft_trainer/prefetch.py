"""A bounded prefetch of the features of the micro-batches a rank will train on next.

The trainer hands over its micro-batches in the order it will ``take`` them (``start``). Slots are
admitted in that order while the bytes of the samples they must fetch stay within ``max_bytes`` (one
slot always, however large); each admitted slot is one request, put on a queue that ``n_workers``
threads share (the source decides which server a worker talks to: servers x requests per server),
so the window stays full with several requests in flight per server and every server takes work as
it frees up. ``take`` waits for the head slot only; a slot completes when every sample it asked for
arrived (a source retries and moves between servers itself: a slot is never handed out partly).

Errors: the first exception of a fetch (a deterministic server error naming the sample, or every
server gone for longer than the source's retries) is raised by ``take`` of that slot; ``close``
stops the workers (they finish their current request and exit; threads are daemons so a dying
trainer is never held up).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.errors import DataError

# fetch(positions, worker) -> the samples at those positions, in any order
FetchFn = Callable[[list[int], int], Iterator[tuple[int, ExtractedSample]]]


@dataclass
class _Slot:
    positions: list[int]
    to_fetch: list[int]
    n_bytes: int
    got: dict[int, ExtractedSample] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class PrefetchStats:
    wait_s: float = 0.0  # the consumer blocked in take()
    fetched_samples: int = 0
    fetched_tokens: int = 0
    fetched_bytes: int = 0  # bf16 states received
    fetch_s: float = 0.0  # summed over the workers: time inside a request

    def as_dict(self) -> dict[str, float]:
        return {
            "data_wait_s": self.wait_s,
            "fetched_samples": self.fetched_samples,
            "fetched_tokens": self.fetched_tokens,
            "fetched_bytes": self.fetched_bytes,
            "fetch_s": self.fetch_s,
        }


class Prefetcher:
    def __init__(self, fetch: FetchFn, n_workers: int, max_bytes: int) -> None:
        if n_workers < 1 or max_bytes < 1:
            raise ValueError(f"n_workers {n_workers} and max_bytes {max_bytes} must be positive")
        self.fetch, self.n_workers, self.max_bytes = fetch, n_workers, max_bytes
        self.stats = PrefetchStats()
        self._slots: deque[_Slot] = deque()
        self._bytes = 0  # of the admitted slots not yet taken
        self._upcoming: Iterator[tuple[list[int], list[int], int]] = iter(())
        self._work: queue.Queue[_Slot | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, upcoming: Iterator[tuple[list[int], list[int], int]]) -> None:
        """``upcoming``: (positions, positions to fetch, bytes to fetch) per micro-batch, in take order."""
        self._upcoming = upcoming
        self._threads = [
            threading.Thread(target=self._work_loop, args=(w,), name=f"eagle3-prefetch-{w}", daemon=True)
            for w in range(self.n_workers)
        ]
        for thread in self._threads:
            thread.start()
        self._admit()

    def next_positions(self) -> list[int] | None:
        """The micro-batch ``take`` hands out next (None: the plan is exhausted)."""
        return self._slots[0].positions if self._slots else None

    @property
    def window_bytes(self) -> int:
        return self._bytes

    def _admit(self) -> None:
        while not self._slots or self._bytes < self.max_bytes:
            nxt = next(self._upcoming, None)
            if nxt is None:
                return
            positions, to_fetch, n_bytes = nxt
            slot = _Slot(list(positions), list(to_fetch), n_bytes)
            self._slots.append(slot)
            self._bytes += n_bytes
            if slot.to_fetch:
                self._work.put(slot)
            else:
                slot.done.set()

    def take(self, positions: list[int]) -> dict[int, ExtractedSample]:
        """The fetched samples of the next micro-batch (which must be ``positions``), by position."""
        if not self._slots:
            raise DataError(f"the prefetch plan has no micro-batch left (asked for positions {positions[:5]})")
        slot = self._slots[0]
        if slot.positions != positions:
            raise DataError(f"micro-batch {positions[:5]}... asked out of plan order (next is {slot.positions[:5]})")
        started = time.perf_counter()
        while not slot.done.wait(0.5):
            if not any(t.is_alive() for t in self._threads):
                raise DataError("every prefetch worker stopped")
        self.stats.wait_s += time.perf_counter() - started
        self._slots.popleft()
        self._bytes -= slot.n_bytes
        if slot.error is not None:
            raise slot.error
        self._admit()
        return slot.got

    def _work_loop(self, worker: int) -> None:
        while not self._stop.is_set():
            try:
                slot = self._work.get(timeout=0.2)
            except queue.Empty:
                continue
            if slot is None:
                return
            started = time.perf_counter()
            try:
                wanted = set(slot.to_fetch)
                for pos, sample in self.fetch(slot.to_fetch, worker):
                    if pos not in wanted or pos in slot.got:
                        raise DataError(f"sample {sample.sample_id!r} arrived for a request that did not ask it")
                    slot.got[pos] = sample
                    n_bytes = int(sample.states_nbytes)
                    with self._lock:
                        self.stats.fetched_samples += 1
                        self.stats.fetched_tokens += sample.n_tokens
                        self.stats.fetched_bytes += n_bytes
                    if self._stop.is_set():
                        return
                missing = wanted.difference(slot.got)
                if missing:
                    raise DataError(f"the source ended without {len(missing)} samples of the request")
            except Exception as exc:  # noqa: BLE001 -- handed to the consumer's take(), which raises it
                slot.error = exc
            finally:
                with self._lock:
                    self.stats.fetch_s += time.perf_counter() - started
                slot.done.set()

    def stop(self) -> None:
        """No new request starts; a request in flight ends at its next sample (or when its source closes)."""
        if not self._stop.is_set():
            self._stop.set()
            for _ in self._threads:
                self._work.put(None)

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
