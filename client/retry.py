"""The one retry policy of the SDK, shared by ``ExtractionClient`` and the dataset workers.

What is retried (openai-python's policy): connection errors and timeouts, 408, 409, 429 and 5xx, and
streams that broke in a retryable way (truncated, or an ERROR frame marked retryable); never 400,
401, 413 or a malformed stream. The server's ``x-should-retry`` header overrides the status either way.

How long to wait: ``Retry-After`` when the server sent one (capped at ``max_retry_after_s``), else
``INITIAL_RETRY_DELAY_S * 2**attempt`` capped at ``MAX_RETRY_DELAY_S``, minus up to 25 % jitter.

What a server failure means to a dataset run (``server_failure``): a failure another server (or
the same one, later) may not have sends the batch back to the queue; anything else ends the run.
A busy server (429/503 with ``Retry-After``) is waited for without counting as a failure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from eagle3.client.errors import APIConnectionError, APIError, APIStatusError, StreamError

INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 16.0
MAX_RETRY_AFTER_S = 60.0


def should_retry(exc: APIError) -> bool:
    """Whether trying the same call again may succeed (see the module docstring)."""
    if isinstance(exc, APIStatusError):
        if exc.should_retry is not None:
            return exc.should_retry
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    if isinstance(exc, StreamError):
        return exc.retryable
    return isinstance(exc, APIConnectionError)


def retry_delay_s(exc: APIError, attempt: int, max_retry_after_s: float = MAX_RETRY_AFTER_S) -> float:
    """Retry-After when the server sent one (capped), else 0.5 s * 2^attempt (max 16 s) with jitter."""
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        return float(min(retry_after, max_retry_after_s))
    # the exponent is capped before the power: 2.0 ** 1024 overflows (a long retry budget reaches it)
    backoff = min(INITIAL_RETRY_DELAY_S * 2.0 ** min(attempt, 32), MAX_RETRY_DELAY_S)
    return backoff * (1.0 - 0.25 * random.random())  # noqa: S311 - jitter, not crypto


@dataclass(frozen=True)
class ServerFailure:
    """How a dataset worker treats one failed request: requeue its batch, and for how long to wait."""

    requeue: bool  # False: the failure is deterministic (bad request, bad stream): end the run
    busy: bool  # 429/503 with Retry-After: wait ``delay_s`` without counting a failure


def server_failure(exc: APIError) -> ServerFailure:
    overloaded = isinstance(exc, APIStatusError) and exc.status_code in (429, 503)
    if isinstance(exc, StreamError) and not exc.retryable:
        return ServerFailure(requeue=False, busy=False)
    if not (isinstance(exc, APIConnectionError) or overloaded or should_retry(exc)):
        return ServerFailure(requeue=False, busy=False)
    return ServerFailure(requeue=True, busy=overloaded and getattr(exc, "retry_after_s", None) is not None)
