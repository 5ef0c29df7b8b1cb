"""HTTP plumbing of the SDK: one TLS context per process, the ``httpx.Client`` each ``ExtractionClient`` uses,
and the small answers read from a server (``/v1/info``, ``/readyz``, an error envelope).

Why one TLS context: ``httpx.Client()`` builds a fresh ``ssl.SSLContext`` and loads the whole CA bundle
(``$SSL_CERT_FILE``, ``$SSL_CERT_DIR`` or certifi) every time, 0.1-0.5 s of CPU on a busy host, even for
plain ``http://`` URLs. ``extract_dataset`` opens ``requests_per_server`` clients per URL plus a probe,
so that cost sat inside every run's wall time. ``shared_ssl_context`` builds it once (the same
``httpx.create_ssl_context()`` call httpx makes itself, so certificates are verified exactly as
before) and every client of the process shares it; an ``SSLContext`` is safe to share between
connections and threads. The bundle is read at the first client: a CA file changed afterwards is
seen by a new process, not by this one.
"""

from __future__ import annotations

import dataclasses
import ssl
import threading
from typing import Any

import httpx

from eagle3.client.errors import APIError, APIStatusError, status_error
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.wire import ServerInfo

_ssl_lock = threading.Lock()
_ssl_context: ssl.SSLContext | None = None


def shared_ssl_context() -> ssl.SSLContext:
    """The process's one TLS context for verified ``https://`` (built on first use, then reused)."""
    global _ssl_context
    with _ssl_lock:
        if _ssl_context is None:
            _ssl_context = httpx.create_ssl_context()
        return _ssl_context


def new_http_client(timeout_s: float, transport: httpx.BaseTransport | None) -> httpx.Client:
    """The ``httpx.Client`` of one ``ExtractionClient``: ``timeout_s`` per read (connect at most 10 s),
    no redirects, the shared TLS context (a ``transport`` of the caller's brings its own)."""
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    verify: ssl.SSLContext | bool = shared_ssl_context() if transport is None else True
    return httpx.Client(timeout=timeout, transport=transport, follow_redirects=False, verify=verify)


def per_call_timeout(timeout_s: float | None) -> dict[str, Any]:
    """``httpx`` keyword arguments for one call's own ``timeout_s`` (``extract(..., timeout_s=...)``, as
    openai-python's per-request ``timeout=``): the same read/connect split as the client's; none when None."""
    if timeout_s is None:
        return {}
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return {"timeout": httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))}


def new_async_http_client(timeout_s: float, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """``new_http_client`` for ``AsyncExtractionClient``: the same timeouts, redirects and TLS context."""
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    verify: ssl.SSLContext | bool = shared_ssl_context() if transport is None else True
    return httpx.AsyncClient(timeout=timeout, transport=transport, follow_redirects=False, verify=verify)


def parse_server_info(data: Any, url: str) -> ServerInfo:
    """``GET /v1/info`` as the typed ``ServerInfo`` (``eagle3.core.protocol.wire``); a malformed answer
    is an ``APIError`` naming the field."""
    try:
        return dataclasses.replace(ServerInfo.from_dict(data), url=url)
    except ProtocolError as exc:
        raise APIError(f"{url}/v1/info: unexpected answer ({exc})", url=url) from None


def describe_readyz(resp: httpx.Response) -> str:
    """One line from a ``/readyz`` answer: status, phase, progress, elapsed and expected load time."""
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code} {resp.text[:200]}"
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}"
    text = f"{body.get('status', resp.status_code)}"
    if body.get("phase"):
        text += f", {body['phase']}"
    if isinstance(body.get("progress"), int | float):
        text += f" ({body['progress']:.0%})"
    if isinstance(body.get("elapsed_s"), int | float):
        text += f", loading for {body['elapsed_s']:.0f} s"
        if isinstance(body.get("expected_s"), int | float):
            text += f" of about {body['expected_s']:.0f} s (the last load)"
    return text


def response_status_error(resp: httpx.Response, url: str) -> APIStatusError:
    """The typed error of a non-2xx answer (its JSON error envelope, or whatever body came back)."""
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    return status_error(resp.status_code, body, {k.lower(): v for k, v in resp.headers.items()}, url)
