"""The one JSON error envelope every non-2xx response carries (docs/protocol.md, "Errors"); its
``x-should-retry`` header comes from the error-type table (core/protocol/error_types.py)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol.error_types import default_type, is_retryable


class ApiError(Eagle3Error):
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
        self.type = type_ or default_type(status)
        self.message = message
        self.param = param
        self.reason = reason
        self.retry_after_s = retry_after_s

    def response(self, request_id: str | None = None) -> JSONResponse:
        retryable = is_retryable(self.type, self.status)  # core/protocol/error_types.py: the one table
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
