"""The FastAPI app: routes, auth, request ids, body limits and the one error envelope.

``create_app(settings, backend=None)`` builds everything per app; the lifespan starts the backend
load (in a thread, so the port answers probes at once) and stops it. Auth guards every route but
``/livez`` and ``/readyz``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eagle3.core.protocol.frames import CODEC_NAMES
from eagle3.server.backends import Backend
from eagle3.server.config import ServerSettings
from eagle3.server.errors import ApiError
from eagle3.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from eagle3.server.openapi import EXTRACT_OPENAPI, install_openapi, package_version
from eagle3.server.request_limits import (
    ClientGoneError,
    TenantConnections,
    check_content_type,
    install_access_log_redaction,
    read_body,
)
from eagle3.server.request_log import log_api_call
from eagle3.server.runtime import Runtime
from eagle3.server.scheduler import AdmissionError
from eagle3.server.status_page import render_status_page, status_data
from eagle3.server.stream import EncodeOptions, ExtractStream, FrameStreamResponse, stream_header
from eagle3.server.validation import check_samples, parse_request

logger = logging.getLogger(__name__)
TENANT_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
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


def runtime_of(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def authenticate(request: Request) -> str:
    """The caller's tenant name; 401 unless a configured key matches (constant-time, every key tried)."""
    tenant = _authenticate(request)
    request.state.tenant = tenant
    return tenant


def authenticate_unless(public: str) -> Callable[[Request], str | None]:
    """``authenticate``, skipped when the setting named ``public`` (public_metrics, public_status) is on."""

    def check(request: Request) -> str | None:
        return None if getattr(runtime_of(request).settings, public) else authenticate(request)

    return check


def _authenticate(request: Request) -> str:
    keys = runtime_of(request).settings.api_keys
    if not keys:
        tenant = request.headers.get("x-eagle3-tenant", "default")
        if not TENANT_RE.match(tenant):
            raise ApiError(400, "X-Eagle3-Tenant must be 1-64 characters of [A-Za-z0-9_.:-]", param="X-Eagle3-Tenant")
        return tenant
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), given) and scheme.lower() == "bearer":
            found = tenant
    if found is None:
        raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")
    return found


def unavailable(rt: Runtime) -> ApiError | None:
    if rt.status == "ready":
        return None
    reason = {"loading": "loading", "draining": "draining"}.get(rt.status, "failed")
    message = {
        "loading": f"model is loading ({rt.phase}, {rt.progress:.0%})",
        "draining": "server is shutting down",
        "failed": f"model failed to load: {rt.error}",
    }[rt.status]
    return ApiError(503, message, reason=reason, retry_after_s=5 if rt.status == "loading" else 10)


def create_app(settings: ServerSettings, backend: Backend | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = Runtime(settings, backend)
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
        redoc_url=None,
    )
    connections = TenantConnections(settings.max_tenant_connections)
    install_access_log_redaction()
    app.add_middleware(RequestIdMiddleware)
    install_openapi(app)
    auth = [Depends(authenticate)]

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

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        rt = runtime_of(request)
        if rt.status == "ready":
            return JSONResponse({"status": "ready"})
        body = {
            "status": rt.status,
            "phase": rt.phase,
            "progress": rt.progress,
            "elapsed_s": round(time.monotonic() - rt.started_at, 3),
            **rt.load_estimate(),
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/v1/info", dependencies=auth)
    async def info(request: Request) -> JSONResponse:
        rt = runtime_of(request)
        if rt.info is None:
            raise unavailable(rt) or ApiError(503, "model is loading", reason="loading", retry_after_s=5)
        return JSONResponse(rt.describe().to_dict())

    @app.get("/metrics", dependencies=[Depends(authenticate_unless("public_metrics"))], include_in_schema=False)
    async def metrics(request: Request) -> Response:
        return Response(runtime_of(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/status", dependencies=[Depends(authenticate_unless("public_status"))])
    async def status_json(request: Request) -> JSONResponse:
        """The status page's figures: model, load phase, uptime, per-tenant work, throughput, recent errors."""
        return JSONResponse(status_data(runtime_of(request)))

    @app.get("/", dependencies=[Depends(authenticate_unless("public_status"))], include_in_schema=False)
    async def status_page(request: Request) -> HTMLResponse:
        return HTMLResponse(render_status_page(status_data(runtime_of(request))))

    @app.post("/v1/extract", openapi_extra=EXTRACT_OPENAPI)
    async def extract(request: Request, tenant: str = Depends(authenticate)) -> Response:
        rt = runtime_of(request)
        if (err := unavailable(rt)) is not None:
            raise err
        assert rt.info is not None
        check_content_type(request)
        connections.acquire(tenant)  # released when the response ends, whatever happens from here
        try:
            return await _extract(request, tenant, rt)
        except BaseException:
            connections.release(tenant)
            raise

    async def _extract(request: Request, tenant: str, rt: Runtime) -> Response:
        assert rt.info is not None
        try:
            body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        except ClientGoneError:
            connections.release(tenant)
            return Response(status_code=400)  # nobody reads it
        parsed = parse_request(body)
        check = functools.partial(
            check_samples,
            parsed,
            vocab_size=rt.info.vocab_size,
            max_model_len=rt.info.max_model_len,
            max_request_tokens=settings.request_token_cap,
            chat=rt.chat,
            chat_limits=rt.chat_limits,
        )
        if not rt.tokenize_slots.acquire(blocking=False):  # bounded: a flood waits in no unbounded queue
            rt.metrics.inc("eagle3_rejections_total", tenant=tenant, reason="overloaded")
            raise ApiError(
                503, "too many requests being validated; retry shortly", reason="overloaded", retry_after_s=1
            )
        job = rt.tokenize_pool.submit(check)  # the slot comes back when the job ends, even if we stop waiting
        job.add_done_callback(lambda _: rt.tokenize_slots.release())
        samples = await asyncio.wrap_future(job)
        if (err := unavailable(rt)) is not None:  # it may have started draining meanwhile
            raise err
        request_id = request.state.request_id
        try:
            req = rt.scheduler.submit(request_id, tenant, samples)
        except AdmissionError as exc:
            raise ApiError(
                exc.status, str(exc), type_=exc.type, reason=exc.reason, retry_after_s=exc.retry_after_s
            ) from None
        codec = rt.codec_for(parsed.codec or settings.default_codec, request.client.host if request.client else None)
        header = dataclasses.replace(
            stream_header(rt.info, request_id, len(samples), req.n_tokens, settings.max_payload_bytes),
            codec=next(name for name, c in CODEC_NAMES.items() if c == codec),
        )
        opts = EncodeOptions(codec, parsed.zstd_level, settings.max_payload_bytes)
        stream = ExtractStream(
            rt.scheduler, req, header, opts, rt.executor, rt.metrics, settings.heartbeat_s, settings.stream_chunk_bytes
        )
        headers = {"X-Request-Id": request_id, "Cache-Control": "no-store"}
        return FrameStreamResponse(stream, headers=headers, on_close=lambda: connections.release(tenant))

    return app
