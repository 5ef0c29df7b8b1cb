"""What one connection may cost before its request is validated: the request body must arrive within
``body_timeout_s`` (else 408), be JSON by its ``Content-Type`` (else 415) and within ``--max-body-mb``
(else 413); a tenant holds at most ``max_tenant_connections`` extract requests at once, streams included
(else 429 ``tenant_connections``). A client that vanishes during its upload costs one info line.
Access-log lines never carry a query string (a key sent as ``?api_key=...`` must not reach a log).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request

from eagle3.core.errors import Eagle3Error
from eagle3.server.errors import ApiError

logger = logging.getLogger(__name__)
JSON_TYPES = ("application/json",)


class ClientGoneError(Eagle3Error):
    """The client closed its connection before its body arrived (nothing to answer)."""


def check_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in JSON_TYPES:
        shown = media or "none"
        raise ApiError(415, f"Content-Type is {shown}; send the body as application/json", param="Content-Type")


async def read_body(request: Request, limit_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit_bytes`` (Content-Length is only a hint)
    and with 408 unless all of it arrived within ``timeout_s``. ``ClientGoneError`` when the client left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise ApiError(413, f"body is {declared} bytes, over the {limit_bytes}-byte limit (--max-body-mb)")
    chunks, n_bytes = [], 0
    deadline = time.monotonic() + timeout_s
    stream = request.stream().__aiter__()
    try:
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), left_s)
            except StopAsyncIteration:
                break
            n_bytes += len(chunk)
            if n_bytes > limit_bytes:
                raise ApiError(413, f"body is over the {limit_bytes}-byte limit (--max-body-mb)")
            chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s); {n_bytes} bytes came"
        ) from None
    except ClientDisconnect:
        logger.info("request %s: client disconnected during upload after %d bytes", request_id(request), n_bytes)
        raise ClientGoneError from None
    return b"".join(chunks)


def request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", "-"))


class TenantConnections:
    """Open extract requests per tenant (from auth to the end of the stream), capped."""

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> None:
        with self._lock:
            n = self._open.get(tenant, 0)
            if n >= self.max_per_tenant:
                raise ApiError(
                    429,
                    f"tenant {tenant!r} already has {n} extract requests open (--max-tenant-connections); "
                    "wait for one to finish",
                    reason="tenant_connections",
                    retry_after_s=1,
                )
            self._open[tenant] = n + 1

    def release(self, tenant: str) -> None:
        with self._lock:
            n = self._open.get(tenant, 0) - 1
            if n > 0:
                self._open[tenant] = n
            else:
                self._open.pop(tenant, None)

    def open(self, tenant: str) -> int:
        with self._lock:
            return self._open.get(tenant, 0)


class RedactQuery(logging.Filter):
    """Drops the query string from uvicorn's access-log path (args[2]): it may hold a secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[redacted]", *args[3:])
        return True


def install_access_log_redaction() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQuery) for f in access.filters):
        access.addFilter(RedactQuery())
