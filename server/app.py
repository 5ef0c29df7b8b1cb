"""The FastAPI app: ``create_app(settings, backend=None)`` wires the lifespan (it owns the ``Runtime``:
backend load in a thread, so the port answers probes at once, and stop), request ids, the one error
envelope, OpenAPI and the two routers of ``server/routes.py``. No module-level state: two apps in one
process share nothing. Auth (``server/deps.py``) guards every route but ``/livez`` and ``/readyz``
(and what a ``--public-*`` setting opens).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eagle3.server.backends import Backend
from eagle3.server.config import ServerSettings
from eagle3.server.deps import runtime_of
from eagle3.server.errors import ApiError
from eagle3.server.metrics import package_version
from eagle3.server.openapi import install_openapi
from eagle3.server.request_limits import (
    install_access_log_redaction,
)
from eagle3.server.request_log import log_api_call
from eagle3.server.routes import api, probes
from eagle3.server.runtime import Runtime
from eagle3.server.tenants import AnonymousTenants

logger = logging.getLogger(__name__)
REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or make one) on every response, streams included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = sent if REQUEST_ID_RE.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.monotonic(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("X-Request-Id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            if not (path == "/v1/extract" and status == 200):  # a stream logs itself when it ends
                log_api_call(scope.get("method", ""), path, status, time.monotonic() - started, request_id)


def create_app(
    settings: ServerSettings, backend: Backend | None = None, *, freeze_gc_when_ready: bool = False
) -> FastAPI:
    """``freeze_gc_when_ready``: for the process that exists to serve this app (``eagle3 serve``), see
    ``Runtime``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = Runtime(settings, backend, freeze_gc_when_ready=freeze_gc_when_ready)
        app.state.runtime = rt
        rt.start()
        try:
            yield
        finally:
            await asyncio.to_thread(rt.stop)

    app = FastAPI(
        title="eagle3 extraction server",
        version=package_version(),
        description="Hidden states of a resident verifier for EAGLE-3 draft training. The /v1/extract response "
        "is a binary frame stream (application/x-eagle3-frames), documented in docs/protocol.md.",
        lifespan=lifespan,
        openapi_url=None,  # served by install_openapi, behind the key unless --public-openapi
        docs_url=None,  # no Swagger UI: FastAPI's loads from a public CDN (server/openapi.py)
        redoc_url=None,
    )
    app.state.anonymous_tenants = AnonymousTenants(settings.max_anonymous_tenants)  # without keys: server/tenants.py
    install_access_log_redaction()
    app.add_middleware(RequestIdMiddleware)
    install_openapi(app)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # admission refusals (tenant_quota, overloaded) were counted by Scheduler.submit already
        counted = exc.reason in ("tenant_quota", "overloaded")
        tenant = getattr(request.state, "tenant", "-")
        metrics = runtime_of(request).metrics
        if exc.type in ("payload_too_large", "rate_limited", "unavailable") and not counted:
            metrics.inc("eagle3_rejections_total", tenant=tenant, reason=exc.reason or exc.type)
        if exc.status != 401:  # bad keys are not a tenant's error (and would flood the page)
            metrics.note_error(exc.reason or exc.type, tenant, request.state.request_id, str(exc))
        return exc.response(request.state.request_id)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response(request.state.request_id)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return ApiError(400, str(exc.errors()[:1])).response(request.state.request_id)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return ApiError(500, "internal server error").response(request.state.request_id)

    app.include_router(probes)
    app.include_router(api)
    return app
