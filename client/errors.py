"""Errors raised by the extraction SDK. Every message is one line a user can act on.

The tree (catch the narrowest class you can handle)::

    Eagle3Error
    ├── APIError                       talking to an extraction server failed
    │   ├── APIStatusError             the server answered with an error status and envelope
    │   │   ├── BadRequestError            400 invalid_request (bad ids, over-long sample, ...)
    │   │   ├── AuthenticationError        401 unauthorized (missing or wrong API key)
    │   │   ├── PayloadTooLargeError       413 payload_too_large (request body over --max-body-mb)
    │   │   ├── RateLimitError             429 rate_limited (tenant over its token quota)
    │   │   ├── ServiceUnavailableError    503 unavailable: loading | draining | overloaded
    │   │   └── InternalServerError        500 and any other 5xx
    │   ├── APIConnectionError         no HTTP answer: refused, reset, DNS, ...
    │   │   ├── APITimeoutError            connect/read timeout (no frame or heartbeat in time)
    │   │   └── NoServerAvailableError     extract_dataset: every server failed, retries spent
    │   └── StreamError                the 200 frame stream broke: truncated, bad checksum, bad frame,
    │                                  or a terminal ERROR frame from the server
    ├── InvalidSampleError             a sample given to the SDK is malformed (checked before sending)
    ├── SampleFailedError              the server rejected some samples; the others were delivered
    ├── IncompatibleError              server, prepared data and features directory disagree
    │                                  (model, revision, layer ids, tokenizer, vocab size)
    └── FeaturesWriteError             a features directory cannot be written (full disk, ...)
        ├── FeaturesLockedError            another writer holds the features directory
        └── InsufficientDiskError          the free-disk pre-check failed (says how much is needed)

Every class here imports from ``eagle3`` too (``from eagle3 import APIError``), and every other error
eagle3 raises (bad prepared/features files, bad settings, trainer errors, ...) derives from the same
root, so ``except eagle3.Eagle3Error`` catches anything eagle3 raised on purpose.

Retried automatically (``ExtractionClient(max_retries=...)``): APIConnectionError, APITimeoutError,
RateLimitError, ServiceUnavailableError, InternalServerError, retryable StreamError, unless the
server said ``x-should-retry: false``. Never retried: 400, 401, 413.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The root and the features-directory errors live in the core (the features writer raises them); they
# are part of this tree and re-exported here so ``from eagle3.client.errors import ...`` covers it all.
from eagle3.core.errors import (
    Eagle3Error,
    FeaturesLockedError,
    FeaturesWriteError,
    IncompatibleError,
    InsufficientDiskError,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "Eagle3Error",
    "FeaturesLockedError",
    "FeaturesWriteError",
    "IncompatibleError",
    "InsufficientDiskError",
    "InternalServerError",
    "InvalidSampleError",
    "NoServerAvailableError",
    "PayloadTooLargeError",
    "RateLimitError",
    "SampleFailedError",
    "SampleFailure",
    "ServiceUnavailableError",
    "StreamError",
    "status_error",
]


class APIError(Eagle3Error):
    """A request to an extraction server failed. ``url`` names the server."""

    def __init__(self, message: str, *, url: str = "", request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.request_id = request_id


class APIStatusError(APIError):
    """A non-2xx answer carrying the server's JSON error envelope."""

    status_code: int = 0

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        status_code: int,
        type: str = "",
        param: str | None = None,
        reason: str | None = None,
        request_id: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message, url=url, request_id=request_id)
        self.status_code = status_code
        self.type = type
        self.param = param
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry


class BadRequestError(APIStatusError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class PayloadTooLargeError(APIStatusError):
    status_code = 413


class RateLimitError(APIStatusError):
    status_code = 429


class ServiceUnavailableError(APIStatusError):
    status_code = 503


class InternalServerError(APIStatusError):
    status_code = 500


class APIConnectionError(APIError):
    """No HTTP answer from the server (connection refused or reset, DNS failure, ...)."""


class APITimeoutError(APIConnectionError):
    """The server did not answer (or stopped streaming, heartbeats included) within ``timeout_s``."""


class NoServerAvailableError(APIConnectionError):
    """Every server of an ``extract_dataset`` run failed repeatedly; the work done so far is on disk."""


class StreamError(APIError):
    """The frame stream of a 200 response is unusable. ``retryable`` says whether trying again may help."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        request_id: str | None = None,
        retryable: bool = True,
        type: str = "stream",
        completed_sample_ids: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message, url=url, request_id=request_id)
        self.retryable = retryable
        self.type = type
        self.completed_sample_ids = completed_sample_ids


class InvalidSampleError(Eagle3Error, ValueError):
    """A sample passed to ``extract`` is malformed (not token ids, messages or a known dict shape)."""


@dataclass(frozen=True)
class SampleFailure:
    """One sample the server could not extract (a SAMPLE_ERROR frame)."""

    sample_id: str
    type: str
    message: str
    retryable: bool = False


class SampleFailedError(Eagle3Error):
    """Some samples failed; every other sample of the call was delivered before this was raised."""

    def __init__(self, failures: list[SampleFailure]) -> None:
        first = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(f"sample {first.sample_id!r} failed: {first.type}: {first.message}{more}")
        self.failures = failures


_STATUS_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    413: PayloadTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def status_error(
    status_code: int, body: Any, headers: dict[str, str], url: str
) -> APIStatusError:  # headers: lower-case names
    """Build the typed error for a non-2xx answer from its JSON envelope (or whatever body came back)."""
    envelope = body.get("error") if isinstance(body, dict) else None
    if not isinstance(envelope, dict):
        text = str(body)[:200] if body else ""
        envelope = {"type": "http_error", "message": text or f"HTTP {status_code}"}
    cls = _STATUS_CLASSES.get(status_code, InternalServerError if status_code >= 500 else APIStatusError)
    retry_after = _retry_after_s(headers)
    should = headers.get("x-should-retry")
    reason = envelope.get("reason")
    type_ = str(envelope.get("type", ""))
    detail = f"{type_}" + (f" ({reason})" if reason else "")
    message = f"{url}: HTTP {status_code} {detail}: {envelope.get('message', '')}".rstrip(": ")
    return cls(
        message,
        url=url,
        status_code=status_code,
        type=type_,
        param=envelope.get("param"),
        reason=reason,
        request_id=headers.get("x-request-id"),
        retry_after_s=retry_after,
        should_retry=None if should is None else should.lower() == "true",
    )


def _retry_after_s(headers: dict[str, str]) -> float | None:
    """``retry-after-ms`` or ``Retry-After`` in seconds (HTTP-date forms are ignored)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                seconds = float(value) * scale
            except ValueError:
                continue
            if seconds >= 0:
                return seconds
    return None
