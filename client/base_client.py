"""What ``ExtractionClient`` and ``AsyncExtractionClient`` share: everything but the I/O (sans-IO).

openai-python's ``_base_client`` pattern: one policy, two thin transports. The sync client (``sdk.py``,
``httpx.Client``) and the async one (``async_sdk.py``, ``httpx.AsyncClient``) differ only in how they
send a request, read a body and sleep; these pieces decide everything else, once:

* ``BaseClient``: the settings (URLs and ``$EAGLE3_SERVER_URL``, the API key and ``$EAGLE3_API_KEY``,
  retries, cache mode), the current URL, the request headers and body, ``/v1/info`` parsing and its
  protocol check, the server's request limits, and what happens before a retry (the delay of
  ``client/retry.py``, moving to the next URL after a connection error or 503, the log line);
* ``split_requests``: the cut of a call's samples into requests within ``max_request_tokens`` and
  ``max_body_bytes``;
* ``BatchAttempts``: one request's samples across attempts (only the samples not received are sent
  again; the retry budget starts again whenever an attempt delivered a sample; retryable
  SAMPLE_ERRORs are asked again while the budget lasts, then reported);
* ``InputOrder``: ``ordered=True`` release in input order and the final ``SampleFailedError``;
* ``transport_error``: httpx and frame-stream exceptions -> the SDK's typed errors (``client/errors.py``);
* ``ReadyPoll``: the bookkeeping of ``wait_until_ready`` (last answer, periodic report, deadline).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

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
from eagle3.client.http_client import describe_readyz, parse_server_info
from eagle3.client.request_samples import consecutive_runs, request_token_cap, request_tokens
from eagle3.client.retry import retry_delay_s, should_retry
from eagle3.client.stream_read import Outcome, StreamCounters
from eagle3.core.protocol.features import DTYPE_BF16, SHARD_CODECS
from eagle3.core.protocol.frames import PROTOCOL_VERSION, ProtocolError, TruncatedStreamError
from eagle3.core.protocol.model_identity import ModelIdentity
from eagle3.core.protocol.wire import CACHE_MODES, ServerInfo
from eagle3.core.sample import ExtractedSample

logger = logging.getLogger("eagle3.client.sdk")

API_KEY_ENV = "EAGLE3_API_KEY"
SERVER_URL_ENV = "EAGLE3_SERVER_URL"  # like OPENAI_BASE_URL: the default ``urls`` (comma-separated for several)
DEFAULT_TIMEOUT_S = 120.0  # per read: the server sends a heartbeat every 10 s while it works
DEFAULT_MAX_RETRIES = 5
# requests of one call streaming at once (client/request_pipeline.py): the next request's forward pass runs
# while the caller reads the current one; each more holds one more request's samples in memory
DEFAULT_MAX_IN_FLIGHT_REQUESTS = 2
NO_LIMIT = 1 << 62


class BaseClient:
    """The transport-independent state and decisions of an extraction client (see the module docstring)."""

    def __init__(
        self,
        urls: str | list[str] | None,
        api_key: str | None,
        *,
        max_retries: int,
        max_retry_after_s: float,
        cache: str | None,
        dtype: str = DTYPE_BF16,
        max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    ) -> None:
        if urls is None:
            urls = [u.strip() for u in os.environ.get(SERVER_URL_ENV, "").split(",") if u.strip()]
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else list(urls))]
        if not self.urls:
            raise ValueError(f"{type(self).__name__} needs a server URL: pass urls=... or set {SERVER_URL_ENV}")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.max_retries = max_retries
        if cache not in (None, *CACHE_MODES):
            raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
        self.cache = cache
        if dtype not in SHARD_CODECS:
            raise ValueError(f"dtype must be one of {', '.join(SHARD_CODECS)}, got {dtype!r}")
        self.dtype = dtype  # the states' format asked of the server: bfloat16 (lossless) or float8_e4m3fn
        if max_in_flight_requests < 1:
            raise ValueError(f"max_in_flight_requests must be at least 1, got {max_in_flight_requests}")
        self.max_in_flight_requests = max_in_flight_requests
        self.max_retry_after_s = max_retry_after_s
        # bytes received and seconds per client stage, all calls (``client/stream_read.py``): read
        # ``wire_bytes`` for MB/s; ``stage_s`` (receive, verify, decode) is what bench/serving.py reports
        self.counters = StreamCounters()
        self._url_index = 0
        self._limits: tuple[int, int] | None = None  # the server's (max_request_tokens, max_body_bytes)
        self._identity: dict[str, ModelIdentity] = {}  # url -> the model its /v1/info described

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

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, "User-Agent": "eagle3-sdk"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _extract_body(self, requests: list[dict[str, Any]], codec: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"samples": requests}
        if codec is not None:
            body["codec"] = codec
        if self.cache is not None:
            body["cache"] = self.cache
        if self.dtype != DTYPE_BF16:  # a server without FP8 refuses the field (400) rather than ignore it
            body["dtype"] = self.dtype
        return body

    def _server_info(self, data: Any) -> ServerInfo:
        """``/v1/info``'s JSON of the current server, typed and checked; its model identity is remembered so
        that every stream's HEADER is checked against it."""
        info = parse_server_info(data, self.url)
        if info.protocol_version != PROTOCOL_VERSION:
            raise IncompatibleError(
                f"{self.url} speaks eagle3 protocol {info.protocol_version}, this client {PROTOCOL_VERSION}: "
                "upgrade the older of the two"
            )
        self._identity[self.url] = info.identity
        return info

    def use_info(self, info: ServerInfo) -> None:
        """Adopt ``info`` (``/v1/info`` of ``info.url``, read once elsewhere): its identity is what every
        stream's HEADER is checked against and its limits cut requests, without reading it again."""
        self._identity[info.url] = info.identity
        self._remember_limits(info)

    def _remember_limits(self, info: ServerInfo) -> tuple[int, int]:
        limits = info.limits
        self._limits = (limits.get("max_request_tokens", NO_LIMIT), limits.get("max_body_bytes", NO_LIMIT))
        return self._limits

    def retry_delay_s(self, exc: APIError, attempt: int) -> float:
        """Retry-After when the server sent one (capped), else exponential backoff (``client/retry.py``)."""
        return retry_delay_s(exc, attempt, self.max_retry_after_s)

    def _prepare_retry(self, exc: APIError, attempt: int, n_pending: int) -> float:
        """Before retry ``attempt``: move on from a server that refused or is unavailable, log, and return
        the seconds to sleep (the caller sleeps its own way)."""
        delay_s = self.retry_delay_s(exc, attempt)
        if isinstance(exc, (APIConnectionError, ServiceUnavailableError)) and len(self.urls) > 1:
            self._url_index = (self._url_index + 1) % len(self.urls)
        what = f" ({n_pending} samples left)" if n_pending else ""
        logger.warning("%s; retrying on %s in %.1f s%s", exc, self.url, delay_s, what)
        return delay_s

    def _retry_or_raise(self, exc: APIError, attempt: int) -> float:
        """A plain call (no samples) failed: the delay before trying again, or ``exc`` raised."""
        if not should_retry(exc) or attempt >= self.max_retries:
            raise exc
        return self._prepare_retry(exc, attempt, 0)


def new_request_id() -> str:
    return uuid.uuid4().hex


def split_requests(requests: list[dict[str, Any]], limits: tuple[int, int]) -> Iterator[list[dict[str, Any]]]:
    """Consecutive runs of ``requests`` within ``(max_request_tokens, max_body_bytes)``, in order; a single
    sample over the limit goes alone (the server's 400 then names it)."""
    return consecutive_runs(requests, request_tokens, request_token_cap(*limits))


class BatchAttempts:
    """One request's samples across its attempts. Per attempt: ``start()`` gives the samples to send,
    ``take(item)`` says whether to hand an outcome to the caller, ``check_complete(url)`` raises when the
    stream ended short; on an ``APIError``, ``after_error(exc)`` raises it (not retryable, or out of
    retries), returns the last failures to report (every pending sample failed retryably), or None:
    retry after ``client._prepare_retry(exc, attempt, n_pending)``, then ``attempt += 1``."""

    def __init__(self, requests: list[dict[str, Any]], max_retries: int) -> None:
        self.pending = {r["id"]: r for r in requests}
        self.max_retries = max_retries
        self.retries_left = max_retries
        self.attempt = 0
        self._received = 0
        self._retryable: dict[str, SampleFailure] = {}

    @property
    def done(self) -> bool:
        return not self.pending

    def start(self) -> list[dict[str, Any]]:
        self._received = 0
        return list(self.pending.values())

    def take(self, item: Outcome) -> bool:
        if isinstance(item, SampleFailure) and item.retryable and self.retries_left > 0:
            self._retryable[item.sample_id] = item  # ask again on the next attempt
            return False
        del self.pending[item.sample_id]
        self._retryable.pop(item.sample_id, None)
        self._received += 1
        return True

    def check_complete(self, url: str) -> None:
        if not self.pending:
            return
        missing = [i for i in self.pending if i not in self._retryable]
        if missing:
            raise StreamError(f"{url}: the stream ended without samples {missing[:5]}", url=url)
        raise StreamError(f"{url}: {len(self.pending)} samples failed with retryable errors", url=url)

    def after_error(self, exc: APIError) -> list[SampleFailure] | None:
        if self._received:
            self.retries_left, self.attempt = self.max_retries, 0  # progress: the budget starts again
        if not should_retry(exc) or self.retries_left <= 0:
            if self._retryable and set(self.pending) == set(self._retryable):
                failures = [self._retryable.pop(i) for i in list(self.pending)]  # out of retries: report them
                self.pending.clear()
                return failures
            raise exc
        self.retries_left -= 1
        return None


class InputOrder:
    """``extract(ordered=...)``: ``push`` each outcome, get the samples to yield now (input order, samples
    that arrive early held back; or arrival order); ``finish`` raises ``SampleFailedError`` when a
    sample failed and ``on_sample_error="raise"``."""

    def __init__(self, requests: list[dict[str, Any]], ordered: bool, on_sample_error: str) -> None:
        self.order = [r["id"] for r in requests]
        self.ordered = ordered
        self.on_sample_error = on_sample_error
        self.failures: list[SampleFailure] = []
        self._early: dict[str, ExtractedSample | None] = {}  # arrived before its turn (None: failed)
        self._next = 0

    def push(self, item: Outcome) -> list[ExtractedSample]:
        if isinstance(item, SampleFailure):
            logger.warning("sample %r failed: %s: %s", item.sample_id, item.type, item.message)
            self.failures.append(item)
            self._early[item.sample_id] = None
        elif not self.ordered:
            return [item]
        else:
            self._early[item.sample_id] = item
        out: list[ExtractedSample] = []
        while self.ordered and self._next < len(self.order) and self.order[self._next] in self._early:
            ready = self._early.pop(self.order[self._next])
            self._next += 1
            if ready is not None:
                out.append(ready)
        return out

    def finish(self) -> None:
        if self.failures and self.on_sample_error == "raise":
            raise SampleFailedError(self.failures)


def transport_error(exc: Exception, url: str, request_id: str | None, where: str = "") -> APIError:
    """A failure while sending or reading (httpx, or a cut / corrupt frame stream) as the SDK's error:
    truncated streams and transport errors are retryable, a corrupt stream is not."""
    if isinstance(exc, TruncatedStreamError):
        return StreamError(f"{url}: truncated stream ({exc})", url=url, request_id=request_id)
    if isinstance(exc, ProtocolError):
        return StreamError(f"{url}: bad frame stream: {exc}", url=url, request_id=request_id, retryable=False)
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"{url}{where}: timed out ({type(exc).__name__})", url=url, request_id=request_id)
    return APIConnectionError(f"{url}: connection failed: {exc or type(exc).__name__}", url=url)


TRANSPORT_ERRORS = (TruncatedStreamError, ProtocolError, httpx.TransportError)  # TimeoutException is one


NO_ETA_WAIT_S = 1800.0  # timeout_s=None, and no server said when it expects to be loaded: wait this long
ETA_FACTOR, ETA_SLACK_S = 1.5, 120.0  # timeout_s=None: wait max(ETA x 1.5, ETA + 2 min) from the first ETA seen


class ReadyPoll:
    """``wait_until_ready``'s bookkeeping: ``answer`` each URL's ``/readyz`` (a response or the exception),
    True when it is ready; ``end_round`` reports now and then and raises ``APITimeoutError`` past the
    deadline. ``timeout_s=None``: the deadline follows the server's own estimate (``eta_s`` of its
    ``/readyz``, from its last load) the first time one comes: at least that long, with room for a slower
    load (``ETA_FACTOR``, ``ETA_SLACK_S``); ``NO_ETA_WAIT_S`` while no estimate came."""

    def __init__(self, timeout_s: float | None, report: Callable[[str], None] | None, report_every_s: float) -> None:
        self.follow_eta = timeout_s is None
        self.timeout_s = NO_ETA_WAIT_S if timeout_s is None else timeout_s
        self.report = report
        self.report_every_s = report_every_s
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout_s
        self.last = "no answer"
        self._next_report = self.started

    def answer(self, url: str, resp: httpx.Response | httpx.HTTPError) -> bool:
        if isinstance(resp, httpx.HTTPError):
            self.last = f"{url}: {type(resp).__name__}"
            return False
        if resp.status_code == 200:
            return True
        self.last = f"{url}: {describe_readyz(resp)}"
        if self.follow_eta:
            self._follow(resp)
        return False

    def _follow(self, resp: httpx.Response) -> None:
        try:
            body = resp.json()
        except ValueError:
            return
        eta_s = body.get("eta_s") if isinstance(body, dict) else None
        if isinstance(eta_s, int | float) and not isinstance(eta_s, bool):
            self.follow_eta = False  # the first estimate sets the deadline: a server that overruns it is not
            waited_s = time.monotonic() - self.started  # waited for without end
            self.timeout_s = waited_s + max(eta_s * ETA_FACTOR, eta_s + ETA_SLACK_S)
            self.deadline = self.started + self.timeout_s

    def end_round(self, url: str) -> None:
        now = time.monotonic()
        if self.report is not None and now >= self._next_report:
            self._next_report = now + self.report_every_s
            waited_s = now - self.started
            self.report(
                f"waiting for a server to be ready ({waited_s:.0f} s of at most {self.timeout_s:.0f} s): {self.last}"
            )
        if now >= self.deadline:
            raise APITimeoutError(f"no server ready after {self.timeout_s:.0f} s (last: {self.last})", url=url)
