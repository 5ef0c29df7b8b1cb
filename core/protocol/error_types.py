"""Every error ``type`` an eagle3 server sends, and whether a retry can help: the one table.

An error is *retryable* when the same request may succeed later (the server was busy, loading,
draining, or hit a transient fault) and *deterministic* when resending it unchanged can only fail
again (the request or sample itself is wrong, or over a limit). The server derives
``x-should-retry`` and every ``retryable`` field in ERROR / SAMPLE_ERROR frames from this table; the
SDK follows those (client/sdk.py) and falls back to ``retryable_status`` for a foreign proxy's answer.
docs/reliability.md lists the same classes with the test that holds each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorType:
    type: str
    status: int | None  # the HTTP status of a response carrying it; None: sent only inside a stream
    retryable: bool
    meaning: str


ERROR_TYPES: dict[str, ErrorType] = {
    e.type: e
    for e in (
        ErrorType("invalid_request", 400, False, "the body or a sample breaks the schema or a limit"),
        ErrorType("unauthorized", 401, False, "missing or wrong API key"),
        ErrorType("not_found", 404, False, "no such route"),
        ErrorType("method_not_allowed", 405, False, "wrong HTTP method for the route"),
        ErrorType("request_timeout", 408, True, "the body did not arrive within the read timeout"),
        ErrorType("payload_too_large", 413, False, "body over --max-body-mb"),
        ErrorType("unsupported_media_type", 415, False, "request Content-Type is not application/json"),
        ErrorType("rate_limited", 429, True, "tenant over its in-flight token quota or connection cap"),
        ErrorType("internal", 500, True, "unexpected server fault (a bug, or a transient one)"),
        ErrorType("unavailable", 503, True, "loading, draining or overloaded"),
        ErrorType("backend_error", None, True, "the engine failed on a sample for a reason not its input's"),
        ErrorType("invalid_sample", None, False, "the engine rejected the sample's input"),
    )
}


def retryable_status(status: int) -> bool:
    """For a status without a known type (a proxy's answer): 408, 429 and 5xx may succeed later."""
    return status in (408, 429) or status >= 500


def is_retryable(type_: str, status: int | None = None) -> bool:
    """Whether an error of this type (else, this status) may succeed when sent again unchanged."""
    known = ERROR_TYPES.get(type_)
    if known is not None:
        return known.retryable
    return retryable_status(status) if status is not None else False


def default_type(status: int) -> str:
    """The type a response of this status carries when the raiser named none."""
    for e in ERROR_TYPES.values():
        if e.status == status:
            return e.type
    return "internal" if status >= 500 else "invalid_request"


def error_meta(type_: str, message: str, **extra: object) -> dict[str, object]:
    """``{type, message, retryable, ...}`` for an ERROR / SAMPLE_ERROR frame, retryable from the table."""
    return {"type": type_, "message": message, "retryable": is_retryable(type_), **extra}
