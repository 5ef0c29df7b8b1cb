"""``ExtractionClient``: hidden states from one or more eagle3 extraction servers, for notebooks and jobs.

    from eagle3.client.sdk import ExtractionClient
    with ExtractionClient("http://gpu-node:8000") as c:
        for s in c.extract([[1, 2, 3], [{"role": "user", "content": "hi"}, ...]]):
            s.hidden_states        # float32 [n, L, H]: aux taps, then the final pre-norm state

Wire: ``POST /v1/extract`` answers with a frame stream (``core/protocol/frames.py``), read by
``client/stream_read.py`` with ``iter_raw()`` into a ``FrameDecoder`` (bounds and checksums before anything
is parsed); DATA payloads are decoded with ``eagle3.core.codec`` (size bound from the frame meta) and the
chunks of a long sample fill its arrays in token order (``client/stream.py``). What a caller may pass as
samples is normalised by ``client/request_samples.py``; TLS context, ``/readyz`` and error answers by
``client/http_client.py``.

Everything but the I/O (settings, request cut, retry decisions, ordering, error mapping) lives in
``client/base_client.py`` and is shared with ``AsyncExtractionClient`` (``client/async_sdk.py``).

Retries (``client/retry.py``, shared with the dataset workers): connection errors, timeouts, 429, 503,
5xx and truncated or retryable-ERROR streams are retried up to ``max_retries`` times, sleeping
``Retry-After`` (capped at ``max_retry_after_s``) or an exponential backoff with jitter;
``x-should-retry`` overrides the status.
A retry sends only the samples not received yet, and the budget starts again whenever a sample
arrives, so a long stream that breaks now and then still finishes. Connection failures move on to
the next URL of the list.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from functools import partial
from typing import Any, Literal

import httpx

from eagle3.client.base_client import (
    API_KEY_ENV,
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    SERVER_URL_ENV,
    TRANSPORT_ERRORS,
    BaseClient,
    BatchAttempts,
    InputOrder,
    ReadyPoll,
    new_request_id,
    split_requests,
    transport_error,
)
from eagle3.client.buffer_pool import BufferPool
from eagle3.client.errors import APIError
from eagle3.client.http_client import (
    describe_readyz,
    new_http_client,
    parse_server_info,
    per_call_timeout,
    response_status_error,
)
from eagle3.client.request_pipeline import pipelined
from eagle3.client.request_samples import (
    DEFAULT_LOSS_MASK,
    JSON_BYTES_PER_TOKEN,
    Sample,
    request_tokens,
    to_request_samples,
)
from eagle3.client.retry import MAX_RETRY_AFTER_S
from eagle3.client.stream_read import Outcome, read_stream
from eagle3.core.protocol.features import DTYPE_BF16
from eagle3.core.protocol.generate import GenerateResponse
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample

# the names other modules and notebooks import from here (their definitions moved, their behaviour did not)
__all__ = [
    "API_KEY_ENV",
    "DEFAULT_LOSS_MASK",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "JSON_BYTES_PER_TOKEN",
    "SERVER_URL_ENV",
    "ExtractionClient",
    "Outcome",
    "Sample",
    "describe_readyz",
    "parse_server_info",
    "request_tokens",
    "to_request_samples",
]


class ExtractionClient(BaseClient):
    """A client of one or more extraction servers (``urls``): info, readiness and streamed extraction."""

    def __init__(
        self,
        urls: str | list[str] | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_retry_after_s: float = MAX_RETRY_AFTER_S,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        cache: str | None = None,
        dtype: str = DTYPE_BF16,
        buffer_pool: BufferPool | None = None,
        max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    ) -> None:
        """``urls``: one server or several; default ``$EAGLE3_SERVER_URL`` (comma-separated). ``api_key``:
        default ``$EAGLE3_API_KEY``. ``http_client``: an ``httpx.Client`` of yours (proxies, TLS, event
        hooks, or a ``fastapi.testclient.TestClient``); it is used as is and not closed by ``close()``.
        ``cache``: ``"bypass"`` asks the server to compute every sample (not served from nor stored in
        its feature cache); None or ``"use"``: the server's cache serves repeats. ``dtype``: the states'
        format, ``"bfloat16"`` (lossless, the default) or ``"float8_e4m3fn"`` (FP8 codes with per-token,
        per-layer scales, about half the bytes: ``ExtractedSample.fp8_scales``). ``buffer_pool``: the
        samples' memory is recycled from it once nothing references it (``extract_dataset`` passes one).
        ``max_in_flight_requests``: how many of a call's requests stream at once when its samples need more
        than one (``client/request_pipeline.py``; 1: one after the other)."""
        super().__init__(
            urls,
            api_key,
            max_retries=max_retries,
            max_retry_after_s=max_retry_after_s,
            cache=cache,
            dtype=dtype,
            max_in_flight_requests=max_in_flight_requests,
        )
        self._sleep = sleep
        self._allocate = buffer_pool
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else new_http_client(timeout_s, transport)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> ExtractionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- small routes ---------------------------------------------------------------------------

    def info(self) -> ServerInfo:
        """``GET /v1/info`` of the current server (retried like any request)."""
        data = self._with_retries(lambda url: self._get_json(url, "/v1/info"))
        return self._server_info(data)

    def ready(self) -> bool:
        """``GET /readyz`` of the current server: True when it is loaded and not draining."""
        try:
            return self._http.get(self.url + "/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def loading_state(self) -> str | None:
        """None when the current server is ready (or does not answer: the request itself will say
        so); else one line on why not (``describe_readyz``)."""
        try:
            resp = self._http.get(self.url + "/readyz")
        except httpx.HTTPError:
            return None
        return None if resp.status_code == 200 else describe_readyz(resp)

    def wait_until_ready(
        self,
        timeout_s: float | None = 1800.0,
        poll_s: float = 2.0,
        *,
        report: Callable[[str], None] | None = None,
        report_every_s: float = 30.0,
    ) -> None:
        """Block until some server of the list answers ``/readyz`` 200 (a large verifier loads for minutes).
        ``report`` gets a line (phase, elapsed, the server's expected load time) at once and then every
        ``report_every_s``: a long wait is never silent. ``timeout_s=None``: as long as the server itself
        expects to load and then some (``ReadyPoll``)."""
        poll = ReadyPoll(timeout_s, report, report_every_s)
        while True:
            for index, url in enumerate(self.urls):
                try:
                    answer: httpx.Response | httpx.HTTPError = self._http.get(url + "/readyz")
                except httpx.HTTPError as exc:
                    answer = exc
                if poll.answer(url, answer):
                    self._url_index = index
                    return
            poll.end_round(self.url)
            self._sleep(poll_s)

    # -- generation (client/generate.py) ---------------------------------------------------------

    def generate(self, prompts: Iterable[Any], **settings: Any) -> GenerateResponse:
        """``POST /v1/generate``: the verifier's reply to each prompt; ``settings`` are those of
        ``eagle3.client.generate.generate`` (max_new_tokens, temperature, top_p, seed, stop_token_ids,
        timeout_s)."""
        from eagle3.client.generate import generate

        return generate(self, prompts, **settings)

    # -- extraction -----------------------------------------------------------------------------

    def extract(
        self,
        samples: Iterable[Sample],
        codec: str | None = None,
        *,
        ordered: bool = True,
        on_sample_error: Literal["raise", "skip"] = "raise",
        timeout_s: float | None = None,
    ) -> Iterator[ExtractedSample]:
        """Yield one ``ExtractedSample`` per input sample (in input order unless ``ordered=False``).

        Samples: lists of token ids, lists of chat messages, ``{"id", "input_ids", "loss_mask"}`` or
        ``{"id", "messages"}`` dicts, or ``PreparedSample``. A sample the server rejects does not stop
        the others: with ``on_sample_error="raise"`` a ``SampleFailedError`` naming it comes after
        every other sample was yielded; with ``"skip"`` it is logged and left out. ``timeout_s``: this
        call's read timeout instead of the client's (as openai-python's per-request ``timeout=``).
        """
        requests = to_request_samples(samples)  # validate now, not at the first next()
        per_call_timeout(timeout_s)  # a bad value fails here, not at the first next()
        order = InputOrder(requests, ordered, on_sample_error)
        return self._extract_ordered(requests, codec, order, timeout_s)

    def _extract_ordered(
        self, requests: list[dict[str, Any]], codec: str | None, order: InputOrder, timeout_s: float | None = None
    ) -> Iterator[ExtractedSample]:
        for item in self._extract_all(requests, codec, timeout_s):
            yield from order.push(item)
        order.finish()

    def extract_stream(
        self, samples: Iterable[Sample], codec: str | None = None, *, timeout_s: float | None = None
    ) -> Iterator[Outcome]:
        """Every sample exactly once, in arrival order: an ``ExtractedSample`` or a ``SampleFailure``.

        The samples go in as many requests as the server's limits need (``/v1/info``
        ``max_request_tokens`` and ``max_body_bytes``, read once), ``max_in_flight_requests`` of them
        streaming at once, their outcomes request by request in order; a single sample over the limit is
        sent alone (the server's 400 then names it). ``timeout_s`` as in ``extract``."""
        per_call_timeout(timeout_s)
        return self._extract_all(to_request_samples(samples), codec, timeout_s)

    def _extract_all(
        self, requests: list[dict[str, Any]], codec: str | None, timeout_s: float | None = None
    ) -> Iterator[Outcome]:
        limits = self._limits or self._remember_limits(self.info())
        batches = split_requests(requests, limits)
        streams = [partial(self._extract_batch, batch, codec, timeout_s=timeout_s) for batch in batches]
        yield from pipelined(streams, self.max_in_flight_requests)

    def _extract_batch(
        self,
        requests: list[dict[str, Any]],
        codec: str | None,
        stop: threading.Event | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Generator[Outcome, None, None]:
        """One request's samples, retried (only the samples not received) as ``max_retries`` allows; no
        new attempt once ``stop`` is set (the caller left)."""
        batch = BatchAttempts(requests, self.max_retries)
        while not batch.done and not (stop is not None and stop.is_set()):
            try:
                for item in self._stream_once(self.url, batch.start(), codec, timeout_s):
                    if batch.take(item):
                        yield item
                batch.check_complete(self.url)
            except APIError as exc:
                final = batch.after_error(exc)
                if final is not None:
                    yield from final
                    return
                self._sleep(self._prepare_retry(exc, batch.attempt, len(batch.pending)))
                batch.attempt += 1

    def _stream_once(
        self, url: str, requests: list[dict[str, Any]], codec: str | None, timeout_s: float | None = None
    ) -> Iterator[Outcome]:
        body = self._extract_body(requests, codec)
        request_id = new_request_id()
        headers, timeout = self._headers(request_id), per_call_timeout(timeout_s)
        try:
            with self._http.stream("POST", url + "/v1/extract", json=body, headers=headers, **timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise response_status_error(resp, url)
                yield from read_stream(
                    resp, url, requests, self._identity.get(url), self.counters, self._allocate, self.dtype
                )
        except TRANSPORT_ERRORS as exc:
            raise transport_error(exc, url, request_id) from None

    # -- plumbing -------------------------------------------------------------------------------

    def _get_json(self, url: str, path: str) -> Any:
        return self._call_json("GET", url, path, new_request_id())

    def _call_json(
        self,
        method: str,
        url: str,
        path: str,
        request_id: str,
        body: Any = None,
        timeout_s: float | None = None,
        parse: bool = True,
    ) -> Any:
        """One JSON call (GET, or POST of ``body``): transport failures and non-200 answers become the
        SDK's typed errors (``client/errors.py``); the parsed JSON (``parse``) or the response otherwise."""
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=10.0)}
        try:
            resp = self._http.request(method, url + path, json=body, headers=self._headers(request_id), **extra)
        except httpx.TransportError as exc:
            raise transport_error(exc, url, None, path) from None
        if resp.status_code != 200:
            raise response_status_error(resp, url)
        return resp.json() if parse else resp

    def _with_retries(self, call: Callable[[str], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return call(self.url)
            except APIError as exc:
                self._sleep(self._retry_or_raise(exc, attempt))
                attempt += 1
