"""The parts of ``extract_dataset`` that run concurrently: a shared batch queue, a byte budget, workers.

``requests_per_server`` ``ServerWorker`` threads per server URL (each its own connection, so the
server computes one request while the client decodes another) pull disjoint request batches from ``BatchSource``
(requeued leftovers first, then new batches cut from the prepared file on demand, so the dataset is
never held in memory) and hands finished samples to the writer through a bounded queue: a worker
blocks on ``ByteBudget`` when the writer falls behind, which stops it reading its stream and lets TCP
slow the server down. A batch whose server fails goes back to the queue (only its missing samples);
the server is skipped for a growing backoff and given up after ``max_failures`` failures in a row.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from eagle3.client.errors import APIError, Eagle3Error, SampleFailure
from eagle3.client.request_samples import consecutive_runs, request_token_cap
from eagle3.client.retry import server_failure
from eagle3.client.sdk import ExtractionClient
from eagle3.core.protocol.prepared import PreparedSample
from eagle3.core.sample import ExtractedSample

logger = logging.getLogger(__name__)

Batch = list[PreparedSample]
BACKOFF_CAP_S = 60.0


def cut_batches(samples: Iterator[PreparedSample], max_tokens: int, max_body_bytes: int) -> Iterator[Batch]:
    """Consecutive samples, up to ``max_tokens`` tokens and about ``max_body_bytes`` of JSON a request."""
    return consecutive_runs(samples, lambda sample: sample.n_tokens, request_token_cap(max_tokens, max_body_bytes))


class BatchSource:
    def __init__(self, batches: Iterator[Batch]) -> None:
        self._batches: Iterator[Batch] | None = batches
        self._requeued: deque[Batch] = deque()
        self._in_flight = 0
        self._lock = threading.Lock()

    def take(self) -> Batch | None:
        with self._lock:
            if self._requeued:
                batch: Batch | None = self._requeued.popleft()
            elif self._batches is not None:
                batch = next(self._batches, None)
                if batch is None:
                    self._batches = None
            else:
                batch = None
            if batch is not None:
                self._in_flight += 1
            return batch

    def finish(self, leftover: Batch) -> None:
        """The taker is done with its batch; ``leftover`` (samples not received) goes back to the queue."""
        with self._lock:
            self._in_flight -= 1
            if leftover:
                self._requeued.append(leftover)

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._batches is None and not self._requeued and self._in_flight == 0


class ByteBudget:
    """At most ``limit`` bytes of decoded samples between the workers and the writer (one always fits)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n_bytes: int, stop: threading.Event) -> bool:
        with self._cond:
            while self.used and self.used + n_bytes > self.limit:
                if stop.is_set():
                    return False
                self._cond.wait(0.2)
            self.used += n_bytes
            return True

    def release(self, n_bytes: int) -> None:
        with self._cond:
            self.used -= n_bytes
            self._cond.notify_all()


class ServerWorker(threading.Thread):
    def __init__(
        self,
        client: ExtractionClient,
        source: BatchSource,
        results: queue.Queue[ExtractedSample | SampleFailure],
        budget: ByteBudget,
        stop: threading.Event,
        *,
        codec: str | None,
        max_failures: int,
        adopt_info: Callable[[ExtractionClient], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(name=f"extract-{client.url}", daemon=True)
        self.client = client
        self.source = source
        self.results = results
        self.budget = budget
        self.stop = stop
        self.codec = codec
        self.max_failures = max_failures
        self.adopt_info = adopt_info  # gives the client its server's /v1/info, checked (client/fetch.py)
        self.sleep = sleep
        self.failures = 0  # in a row
        self.last_error: Exception | None = None
        self.fatal: Exception | None = None
        self.gave_up = False
        self._checked = False

    def run(self) -> None:
        while not self.stop.is_set():
            batch = self.source.take()
            if batch is None:
                if self.source.finished:
                    return
                self.stop.wait(0.05)  # another worker may still hand a batch back
                continue
            leftover = {s.sample_id: s for s in batch}
            try:
                if not self._checked:
                    self.adopt_info(self.client)
                    self._checked = True
                for item in self.client.extract_stream(list(leftover.values()), self.codec):
                    if isinstance(item, ExtractedSample) and not self.budget.acquire(item.states_nbytes, self.stop):
                        return
                    del leftover[item.sample_id]
                    self.results.put(item)
                    self.failures = 0
            except APIError as exc:
                if not self._server_failed(exc):
                    self._fail(exc)
                    return
            except Eagle3Error as exc:
                self._fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a bug must stop the run, not hang it
                self._fail(exc)
                return
            finally:
                self.source.finish(list(leftover.values()))
            if self.gave_up:
                return

    def _server_failed(self, exc: APIError) -> bool:
        """A failure that another server (or this one, later) may not have; False: fatal for the run."""
        failure = server_failure(exc)
        if not failure.requeue:
            return False
        self.last_error = exc
        if failure.busy:  # busy, not broken: wait, do not count
            delay_s = min(float(getattr(exc, "retry_after_s", 0.0) or 0.0), BACKOFF_CAP_S)
        else:
            self.failures += 1
            if self.failures > self.max_failures:
                logger.error("giving up on %s after %d failures in a row: %s", self.client.url, self.failures, exc)
                self.gave_up = True
                return True
            delay_s = min(self.client.retry_delay_s(exc, self.failures - 1) * 2, BACKOFF_CAP_S)
        logger.warning("%s; its batch goes back to the queue, server skipped for %.1f s", exc, delay_s)
        self._pause(delay_s)
        return True

    def _pause(self, delay_s: float) -> None:
        while delay_s > 0 and not self.stop.is_set() and not self.source.finished:
            step_s = min(0.2, delay_s)
            self.sleep(step_s)
            delay_s -= step_s

    def _fail(self, exc: Exception) -> None:
        self.fatal = exc
        self.stop.set()
