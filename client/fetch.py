"""Decoded samples of one model from one or more servers: the engine under ``extract_dataset``, and the
piece a consumer other than a features directory (the trainer streaming its micro-batches) reuses.

``SampleFetcher(urls, api_key, identity, samples, settings)`` cuts ``samples`` (prepared samples, in
order) into requests once, within ``settings.request_tokens`` and the first server's limits, and hands
them to ``requests_per_server`` worker threads per URL (``client/extract_work.py``: each its own
connection; a failed request's missing samples go back to the queue for any server, a server is skipped
with backoff and given up after ``max_retries`` failures in a row). Iterating the fetcher yields every
sample exactly once, in arrival order, as an ``ExtractedSample`` or a ``SampleFailure``; the consumer
calls ``release(sample)`` when it is done with a sample's states, which frees room in the byte budget
(``buffer_bytes`` of decoded states waiting, then the workers stop reading and TCP slows the servers).

Each server's ``/v1/info`` is read once (the caller passes those it already read, ``known``), its model
must be ``identity`` (``ModelIdentity.diff``: any field refused with ``IncompatibleError``), and its
client adopts it (``use_info``: limits and the HEADER check, no second read). A deterministic error
(another model, a bug) stops the fetch and is raised by the iteration; every server given up is a
``NoServerAvailableError``. ``close()`` (or leaving the ``with`` block) stops and joins the workers.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import httpx

from eagle3.client.buffer_pool import BufferPool
from eagle3.client.errors import IncompatibleError, NoServerAvailableError, SampleFailure
from eagle3.client.extract_work import BatchSource, ByteBudget, ServerWorker, cut_batches
from eagle3.client.sdk import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, ExtractionClient
from eagle3.core.protocol.features import DTYPE_BF16
from eagle3.core.protocol.model_identity import ModelIdentity
from eagle3.core.protocol.prepared import PreparedSample
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample

Outcome = ExtractedSample | SampleFailure


@dataclass(frozen=True)
class FetchSettings:
    codec: str | None = None  # None: each server's default_codec
    cache: str | None = None  # "bypass": the server computes every sample (not from its feature cache)
    dtype: str = DTYPE_BF16  # the states asked of the servers: bfloat16, or float8_e4m3fn (FP8)
    request_tokens: int = 65536  # per /v1/extract request (capped by the server's max_request_tokens)
    requests_per_server: int = 2  # in flight at once per server URL: the server computes while we decode
    buffer_bytes: int = 256 << 20  # decoded states waiting for the consumer (back-pressure beyond this)
    pool_bytes: int = 0  # recycled frame buffers (client/buffer_pool.py); 0: fresh memory for every frame
    max_retries: int = DEFAULT_MAX_RETRIES  # failures in a row before a server is given up
    timeout_s: float = DEFAULT_TIMEOUT_S


class _ServerInfos:
    """Each URL's ``/v1/info``, read at most once, checked against the fetch's identity."""

    def __init__(self, urls: list[str], identity: ModelIdentity, known: Iterable[ServerInfo]) -> None:
        self.identity = identity
        self._infos = {info.url: info for info in known}
        self._locks = {url: threading.Lock() for url in urls}

    def adopt(self, client: ExtractionClient) -> None:
        """Give ``client`` its server's info (read now if nobody has), or raise ``IncompatibleError``."""
        with self._locks[client.url]:
            info = self._infos.get(client.url)
            if info is None:
                info = self._infos[client.url] = client.info()
        difference = self.identity.diff(info.identity)
        if difference:
            raise IncompatibleError(
                f"{info.url} serves another model than this extraction's ({difference}; the extraction -> "
                f"{info.url}); give every --server the same checkpoint"
            )
        client.use_info(info)


class SampleFetcher:
    def __init__(
        self,
        urls: list[str],
        api_key: str | None,
        identity: ModelIdentity,
        samples: Iterator[PreparedSample],
        settings: FetchSettings,
        *,
        known: Iterable[ServerInfo] = (),
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if settings.requests_per_server < 1:
            raise ValueError(f"requests_per_server must be at least 1, got {settings.requests_per_server}")
        known = list(known)
        self.settings = settings
        self.infos = _ServerInfos(urls, identity, known)
        limits = known[0] if known else None  # requests are cut once, here, by the first server's limits
        max_tokens = settings.request_tokens
        max_body_bytes = 1 << 40
        if limits is not None:
            max_tokens = min(max_tokens, limits.limit("max_request_tokens", max_tokens))
            max_body_bytes = limits.limit("max_body_bytes", max_body_bytes)
        self.source = BatchSource(cut_batches(samples, max_tokens, max_body_bytes))
        self.results: queue.Queue[Outcome] = queue.Queue()
        self.budget = ByteBudget(settings.buffer_bytes)
        self.stop = threading.Event()
        pool = BufferPool(settings.pool_bytes) if settings.pool_bytes else None
        self.clients = [
            ExtractionClient(
                url,
                api_key,
                timeout_s=settings.timeout_s,
                max_retries=1,  # the workers retry a batch on any server; the client once on its own
                transport=transport,
                sleep=sleep,
                cache=settings.cache,
                dtype=settings.dtype,
                buffer_pool=pool,
                max_in_flight_requests=1,  # one batch = one request here: requests_per_server is the concurrency
            )
            for url in urls
            for _ in range(settings.requests_per_server)
        ]
        self.workers = [
            ServerWorker(
                client,
                self.source,
                self.results,
                self.budget,
                self.stop,
                codec=settings.codec,
                max_failures=settings.max_retries,
                adopt_info=self.infos.adopt,
                sleep=sleep,
            )
            for client in self.clients
        ]
        self._started = False

    def __enter__(self) -> SampleFetcher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Outcome]:
        if not self._started:
            self._started = True
            for worker in self.workers:
                worker.start()
        while True:
            try:
                yield self.results.get(timeout=0.1)
                continue
            except queue.Empty:
                pass
            fatal = next((w.fatal for w in self.workers if w.fatal is not None), None)
            if fatal is not None:
                raise fatal
            if self.source.finished and self.results.empty():
                return
            if all(w.gave_up or not w.is_alive() for w in self.workers) and self.results.empty():
                errors = "; ".join(f"{w.client.url}: {w.last_error}" for w in self.workers)
                raise NoServerAvailableError(
                    f"every server failed {self.settings.max_retries + 1} times in a row ({errors})"
                )

    def release(self, sample: ExtractedSample) -> None:
        """The consumer is done with ``sample``'s states: room for the next ones."""
        self.budget.release(sample.states_nbytes)

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.clients)

    @property
    def stage_s(self) -> dict[str, float]:
        """Seconds per client stage, summed over the request threads."""
        return {k: sum(c.stage_s[k] for c in self.clients) for k in ("receive", "verify", "decode")}

    def close(self) -> None:
        self.stop.set()
        for worker in self.workers:
            if worker.is_alive():
                worker.join(timeout=2.0)
        for client in self.clients:
            client.close()
