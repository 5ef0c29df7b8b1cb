"""The one admission path of the work routes (``POST /v1/extract``, ``POST /v1/generate``).

After the route's gates (the API key, readiness, a JSON ``Content-Type``, the tenant's connection
slot), ``admit``: reads the body within its byte and time limits (413, 408), parses it (400 naming the
field), validates and tokenizes it off the event loop on the bounded tokenize pool (503 ``overloaded``
when full: a flood waits in no unbounded queue), checks readiness again (a drain may have begun
meanwhile), then hands the checked work to the route's ``submit``, which reserves its tokens with the
scheduler (``AdmissionError``: 429 over the tenant's quota, 503 when the server is full, Retry-After).
Each route supplies only what differs: how to parse, how to check, what to open once admitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from eagle3.server.deps import unavailable
from eagle3.server.errors import ApiError
from eagle3.server.request_limits import ClientGoneError, read_body
from eagle3.server.request_state import AdmissionError
from eagle3.server.runtime import Runtime

P = TypeVar("P")  # the parsed body
W = TypeVar("W")  # the checked work
T = TypeVar("T")  # what the route opens once admitted


async def admit(
    request: Request,
    tenant: str,
    rt: Runtime,
    parse: Callable[[bytes], P],
    check: Callable[[P], W],
    submit: Callable[[P, W], T],
) -> T | None:
    """What ``submit`` opened for the admitted work, or None when the client left during the upload
    (nobody reads an answer). Raises ``ApiError`` for every refusal."""
    settings = rt.settings
    try:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    except ClientGoneError:
        return None
    parsed = parse(body)
    if not rt.tokenize_slots.acquire(blocking=False):
        rt.metrics.inc("eagle3_rejections_total", tenant=tenant, reason="overloaded")
        raise ApiError(503, "too many requests being validated; retry shortly", reason="overloaded", retry_after_s=1)
    job = rt.tokenize_pool.submit(check, parsed)  # the slot comes back when the job ends, even if we stop waiting
    job.add_done_callback(lambda _: rt.tokenize_slots.release())
    work = await asyncio.wrap_future(job)
    if (err := unavailable(rt)) is not None:  # it may have started draining meanwhile
        raise err
    try:
        return submit(parsed, work)
    except AdmissionError as exc:
        raise ApiError(
            exc.status, str(exc), type_=exc.type, reason=exc.reason, retry_after_s=exc.retry_after_s
        ) from None
