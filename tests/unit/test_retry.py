"""``client/retry.py``: the one retry policy that ``ExtractionClient`` and the dataset workers share."""

from __future__ import annotations

import pytest

from eagle3.client.errors import APIConnectionError, APIStatusError, APITimeoutError, StreamError, status_error
from eagle3.client.retry import retry_delay_s, server_failure, should_retry


def status(code: int, **headers: str) -> APIStatusError:
    return status_error(code, {"error": {"type": "x", "message": "m"}}, headers, "http://s")


@pytest.mark.parametrize(
    ("exc", "retry", "requeue", "busy"),
    [
        (APIConnectionError("refused"), True, True, False),
        (APITimeoutError("slow"), True, True, False),
        (StreamError("truncated"), True, True, False),
        (StreamError("bad frames", retryable=False), False, False, False),
        (status(400), False, False, False),
        (status(401), False, False, False),
        (status(413), False, False, False),
        (status(500), True, True, False),
        (status(429), True, True, False),
        (status(429, **{"retry-after": "3"}), True, True, True),
        (status(503, **{"retry-after": "3"}), True, True, True),
        (status(503, **{"x-should-retry": "false"}), False, True, False),  # another server may take it
        (status(400, **{"x-should-retry": "true"}), True, True, False),
    ],
)
def test_policy_table(exc, retry, requeue, busy):
    assert should_retry(exc) is retry
    failure = server_failure(exc)
    assert (failure.requeue, failure.busy) == (requeue, busy)


def test_delay_honours_retry_after_with_a_cap_else_backs_off_with_jitter():
    assert retry_delay_s(status(429, **{"retry-after": "7"}), 0) == 7.0
    assert retry_delay_s(status(429, **{"retry-after": "999"}), 0, max_retry_after_s=60.0) == 60.0
    delays = [retry_delay_s(APIConnectionError("x"), attempt) for attempt in range(8)]
    assert 0.375 <= delays[0] <= 0.5 and 0.75 <= delays[1] <= 1.0 and 12 <= delays[7] <= 16
