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

Retries (``client/retry.py``, shared with the dataset workers): connection errors, timeouts, 429, 503,
5xx and truncated or retryable-ERROR streams are retried up to ``max_retries`` times, sleeping
``Retry-After`` (capped at ``max_retry_after_s``) or an exponential backoff with jitter;
``x-should-retry`` overrides the status.
A retry sends only the samples not received yet, and the budget starts again whenever a sample
arrives, so a long stream that breaks now and then still finishes. Connection failures move on to
the next URL of the list.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import httpx

from eagle3.client.errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    IncompatibleError,
    SampleFailedError,
    SampleFailure,
    ServiceUnavailableError,
    StreamError,
)
from eagle3.client.http_client import (
    describe_readyz,
    new_http_client,
    parse_server_info,
    response_status_error,
)
from eagle3.client.request_samples import (
    DEFAULT_LOSS_MASK,
    JSON_BYTES_PER_TOKEN,
    Sample,
    request_tokens,
    to_request_samples,
)
from eagle3.client.retry import MAX_RETRY_AFTER_S, retry_delay_s, should_retry
from eagle3.client.stream_read import Outcome, StreamCounters, read_stream
from eagle3.core.protocol.frames import PROTOCOL_VERSION, ProtocolError, TruncatedStreamError
from eagle3.core.protocol.generate import GenerateResponse
from eagle3.core.protocol.wire import CACHE_MODES, ServerInfo
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

logger = logging.getLogger(__name__)

API_KEY_ENV = "EAGLE3_API_KEY"
SERVER_URL_ENV = "EAGLE3_SERVER_URL"  # like OPENAI_BASE_URL: the default ``urls`` (comma-separated for several)
DEFAULT_TIMEOUT_S = 120.0  # per read: the server sends a heartbeat every 10 s while it works
DEFAULT_MAX_RETRIES = 5


class ExtractionClient:
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
    ) -> None:
        """``urls``: one server or several; default ``$EAGLE3_SERVER_URL`` (comma-separated). ``api_key``:
        default ``$EAGLE3_API_KEY``. ``http_client``: an ``httpx.Client`` of yours (proxies, TLS, event
        hooks, or a ``fastapi.testclient.TestClient``); it is used as is and not closed by ``close()``.
        ``cache``: ``"bypass"`` asks the server to compute every sample (not served from nor stored in
        its feature cache); None or ``"use"``: the server's cache serves repeats."""
        if urls is None:
            urls = [u.strip() for u in os.environ.get(SERVER_URL_ENV, "").split(",") if u.strip()]
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else list(urls))]
        self._layout: dict[str, dict[str, Any]] = {}  # url -> layer ids and hidden size its /v1/info said
        if not self.urls:
            raise ValueError(f"ExtractionClient needs a server URL: pass urls=... or set {SERVER_URL_ENV}")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.max_retries = max_retries
        if cache not in (None, *CACHE_MODES):
            raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
        self.cache = cache
        self.max_retry_after_s = max_retry_after_s
        # bytes received and seconds per client stage, all calls (``client/stream_read.py``): read
        # ``wire_bytes`` for MB/s; ``stage_s`` (receive, verify, decode) is what bench/serving.py reports
        self.counters = StreamCounters()
        self._sleep = sleep
        self._url_index = 0
        self._limits: tuple[int, int] | None = None  # the server's (max_request_tokens, max_body_bytes)
        self._owns_http = http_client is None
        if http_client is not None:
            self._http = http_client
        else:
            self._http = new_http_client(timeout_s, transport)

    @property
    def wire_bytes(self) -> int:
        """Bytes of frame streams received by this client (all calls)."""
        return self.counters.wire_bytes

    @property
    def stage_s(self) -> dict[str, float]:
        """Seconds per client stage (receive, verify, decode), all calls."""
        return self.counters.stage_s

    @property
    def url(self) -> str:
        """The server the next request goes to (connection failures move it along the list)."""
        return self.urls[self._url_index]

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
        info = parse_server_info(data, self.url)
        if info.protocol_version != PROTOCOL_VERSION:
            raise IncompatibleError(
                f"{self.url} speaks eagle3 protocol {info.protocol_version}, this client {PROTOCOL_VERSION}: "
                "upgrade the older of the two"
            )
        self._layout[self.url] = {"aux_layer_ids": list(info.aux_layer_ids), "final_layer_id": info.final_layer_id,
                                  "hidden_size": info.hidden_size}  # fmt: skip
        return info

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
        timeout_s: float = 1800.0,
        poll_s: float = 2.0,
        *,
        report: Callable[[str], None] | None = None,
        report_every_s: float = 30.0,
    ) -> None:
        """Block until some server of the list answers ``/readyz`` 200 (a large verifier loads for minutes).
        ``report`` gets a line (phase, elapsed, the server's expected load time) at once and then every
        ``report_every_s``: a long wait is never silent."""
        started = time.monotonic()
        deadline = started + timeout_s
        last = "no answer"
        next_report = started
        while True:
            for index, url in enumerate(self.urls):
                try:
                    resp = self._http.get(url + "/readyz")
                except httpx.HTTPError as exc:
                    last = f"{url}: {type(exc).__name__}"
                    continue
                if resp.status_code == 200:
                    self._url_index = index
                    return
                last = f"{url}: {describe_readyz(resp)}"
            if report is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + report_every_s
                waited_s = time.monotonic() - started
                report(f"waiting for a server to be ready ({waited_s:.0f} s of at most {timeout_s:.0f} s): {last}")
            if time.monotonic() >= deadline:
                raise APITimeoutError(f"no server ready after {timeout_s:.0f} s (last: {last})", url=self.url)
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
    ) -> Iterator[ExtractedSample]:
        """Yield one ``ExtractedSample`` per input sample (in input order unless ``ordered=False``).

        Samples: lists of token ids, lists of chat messages, ``{"id", "input_ids", "loss_mask"}`` or
        ``{"id", "messages"}`` dicts, or ``PreparedSample``. A sample the server rejects does not stop
        the others: with ``on_sample_error="raise"`` a ``SampleFailedError`` naming it comes after
        every other sample was yielded; with ``"skip"`` it is logged and left out.
        """
        requests = to_request_samples(samples)  # validate now, not at the first next()
        return self._extract_ordered(requests, codec, ordered, on_sample_error)

    def _extract_ordered(
        self, requests: list[dict[str, Any]], codec: str | None, ordered: bool, on_sample_error: str
    ) -> Iterator[ExtractedSample]:
        order = [r["id"] for r in requests]
        early: dict[str, ExtractedSample | None] = {}  # arrived before its turn (None: failed)
        failures: list[SampleFailure] = []
        next_index = 0
        for item in self.extract_stream(requests, codec):
            if isinstance(item, SampleFailure):
                logger.warning("sample %r failed: %s: %s", item.sample_id, item.type, item.message)
                failures.append(item)
                early[item.sample_id] = None
            elif not ordered:
                yield item
                continue
            else:
                early[item.sample_id] = item
            while ordered and next_index < len(order) and order[next_index] in early:
                ready = early.pop(order[next_index])
                next_index += 1
                if ready is not None:
                    yield ready
        if failures and on_sample_error == "raise":
            raise SampleFailedError(failures)

    def extract_stream(self, samples: Iterable[Sample], codec: str | None = None) -> Iterator[Outcome]:
        """Every sample exactly once, in arrival order: an ``ExtractedSample`` or a ``SampleFailure``.

        The samples go in as many requests as the server's limits need (``/v1/info``
        ``max_request_tokens`` and ``max_body_bytes``, read once), one after the other, in order; a
        single sample over the limit is sent alone (the server's 400 then names it)."""
        requests = to_request_samples(samples)
        max_tokens, max_body_bytes = self._request_limits()
        batch: list[dict[str, Any]] = []
        n_tokens = 0
        for req in requests:
            size = request_tokens(req)
            if batch and (n_tokens + size > max_tokens or JSON_BYTES_PER_TOKEN * (n_tokens + size) > max_body_bytes):
                yield from self._extract_batch(batch, codec)
                batch, n_tokens = [], 0
            batch.append(req)
            n_tokens += size
        if batch:
            yield from self._extract_batch(batch, codec)

    def _request_limits(self) -> tuple[int, int]:
        if self._limits is None:
            limits = self.info().limits
            self._limits = (limits.get("max_request_tokens", 1 << 62), limits.get("max_body_bytes", 1 << 62))
        return self._limits

    def _extract_batch(self, requests: list[dict[str, Any]], codec: str | None) -> Iterator[Outcome]:
        """One request's samples, retried (only the samples not received) as ``max_retries`` allows."""
        pending = {r["id"]: r for r in requests}
        retryable_failures: dict[str, SampleFailure] = {}
        retries_left = self.max_retries
        attempt = 0
        while pending:
            received = 0
            try:
                for item in self._stream_once(self.url, list(pending.values()), codec):
                    if isinstance(item, SampleFailure) and item.retryable and retries_left > 0:
                        retryable_failures[item.sample_id] = item  # ask again on the next attempt
                        continue
                    del pending[item.sample_id]
                    retryable_failures.pop(item.sample_id, None)
                    received += 1
                    yield item
                if not pending:
                    return
                missing = [i for i in pending if i not in retryable_failures]
                if missing:
                    raise StreamError(f"{self.url}: the stream ended without samples {missing[:5]}", url=self.url)
                raise StreamError(f"{self.url}: {len(pending)} samples failed with retryable errors", url=self.url)
            except APIError as exc:
                if received:
                    retries_left, attempt = self.max_retries, 0  # progress: the budget starts again
                if not should_retry(exc) or retries_left <= 0:
                    if retryable_failures and set(pending) == set(retryable_failures):
                        for sample_id in list(pending):  # out of retries: report, do not raise
                            del pending[sample_id]
                            yield retryable_failures.pop(sample_id)
                        return
                    raise
                retries_left -= 1
                self._before_retry(exc, attempt, len(pending))
                attempt += 1

    def _stream_once(self, url: str, requests: list[dict[str, Any]], codec: str | None) -> Iterator[Outcome]:
        body: dict[str, Any] = {"samples": requests}
        if codec is not None:
            body["codec"] = codec
        if self.cache is not None:
            body["cache"] = self.cache
        request_id = uuid.uuid4().hex
        try:
            with self._http.stream("POST", url + "/v1/extract", json=body, headers=self._headers(request_id)) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise response_status_error(resp, url)
                expect = self._layout.get(url)
                yield from read_stream(resp, url, requests, expect, self.counters)
        except TruncatedStreamError as exc:
            raise StreamError(f"{url}: truncated stream ({exc})", url=url, request_id=request_id) from None
        except ProtocolError as exc:
            raise StreamError(
                f"{url}: bad frame stream: {exc}", url=url, request_id=request_id, retryable=False
            ) from None
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"{url}: timed out ({type(exc).__name__})", url=url, request_id=request_id) from None
        except httpx.TransportError as exc:
            raise APIConnectionError(f"{url}: connection failed: {exc or type(exc).__name__}", url=url) from None

    # -- plumbing -------------------------------------------------------------------------------

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, "User-Agent": "eagle3-sdk"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _get_json(self, url: str, path: str) -> Any:
        return self._call_json("GET", url, path, uuid.uuid4().hex)

    def _call_json(self, method: str, url: str, path: str, request_id: str, body: Any = None,
                   timeout_s: float | None = None, parse: bool = True) -> Any:  # fmt: skip
        """One JSON call (GET, or POST of ``body``): transport failures and non-200 answers become the
        SDK's typed errors (``client/errors.py``); the parsed JSON (``parse``) or the response otherwise."""
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=10.0)}
        try:
            resp = self._http.request(method, url + path, json=body, headers=self._headers(request_id), **extra)
        except httpx.TimeoutException as exc:
            raise APITimeoutError(f"{url}{path}: timed out ({type(exc).__name__})", url=url) from None
        except httpx.TransportError as exc:
            raise APIConnectionError(f"{url}: connection failed: {exc or type(exc).__name__}", url=url) from None
        if resp.status_code != 200:
            raise response_status_error(resp, url)
        return resp.json() if parse else resp

    def _with_retries(self, call: Callable[[str], Any]) -> Any:
        attempt = 0
        while True:
            try:
                return call(self.url)
            except APIError as exc:
                if not should_retry(exc) or attempt >= self.max_retries:
                    raise
                self._before_retry(exc, attempt, 0)
                attempt += 1

    def retry_delay_s(self, exc: APIError, attempt: int) -> float:
        """Retry-After when the server sent one (capped), else exponential backoff (``client/retry.py``)."""
        return retry_delay_s(exc, attempt, self.max_retry_after_s)

    def _before_retry(self, exc: APIError, attempt: int, n_pending: int) -> None:
        delay_s = self.retry_delay_s(exc, attempt)
        if isinstance(exc, (APIConnectionError, ServiceUnavailableError)) and len(self.urls) > 1:
            self._url_index = (self._url_index + 1) % len(self.urls)
        what = f" ({n_pending} samples left)" if n_pending else ""
        logger.warning("%s; retrying on %s in %.1f s%s", exc, self.url, delay_s, what)
        self._sleep(delay_s)
