"""The one JSON error envelope every non-2xx response carries (docs/protocol.md, "Errors")."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

DEFAULT_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    429: "rate_limited",
    503: "unavailable",
    500: "internal",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        reason: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_ or DEFAULT_TYPES.get(status, "internal" if status >= 500 else "invalid_request")
        self.message = message
        self.param = param
        self.reason = reason
        self.retry_after_s = retry_after_s

    def response(self, request_id: str | None = None) -> JSONResponse:
        retryable = self.status in (408, 429) or self.status >= 500
        headers = {"x-should-retry": "true" if retryable else "false"}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if request_id:
            headers["X-Request-Id"] = request_id
        return JSONResponse(status_code=self.status, content=envelope(self), headers=headers)


def envelope(err: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "type": err.type,
            "message": err.message,
            "code": err.status,
            "param": err.param,
            "reason": err.reason,
        }
    }
