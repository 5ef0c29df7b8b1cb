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
import html
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from eagle3.core.protocol.frames import CODEC_NAMES
from eagle3.server.backends import Backend
from eagle3.server.config import ServerSettings
from eagle3.server.errors import ApiError
from eagle3.server.request_limits import (
    ClientGoneError,
    TenantConnections,
    check_content_type,
    install_access_log_redaction,
    read_body,
)
from eagle3.server.runtime import Runtime
from eagle3.server.scheduler import AdmissionError
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

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


def runtime_of(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def authenticate(request: Request) -> str:
    """The caller's tenant name; 401 unless a configured key matches (constant-time, every key tried)."""
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

    app = FastAPI(title="eagle3 extraction server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    connections = TenantConnections(settings.max_tenant_connections)
    install_access_log_redaction()
    app.add_middleware(RequestIdMiddleware)
    auth = [Depends(authenticate)]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        # admission refusals (tenant_quota, overloaded) were counted by Scheduler.submit already
        counted = exc.reason in ("tenant_quota", "overloaded")
        if exc.type in ("payload_too_large", "rate_limited", "unavailable") and not counted:
            runtime_of(request).metrics.inc("eagle3_rejections_total", reason=exc.reason or exc.type)
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
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/v1/info", dependencies=auth)
    async def info(request: Request) -> JSONResponse:
        rt = runtime_of(request)
        if rt.info is None:
            raise unavailable(rt) or ApiError(503, "model is loading", reason="loading", retry_after_s=5)
        return JSONResponse(rt.describe().to_dict())

    @app.get("/metrics", dependencies=auth)
    async def metrics(request: Request) -> Response:
        return PlainTextResponse(runtime_of(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", dependencies=auth)
    async def status_page(request: Request) -> HTMLResponse:
        rt = runtime_of(request)
        rows = {
            "status": rt.status,
            "phase": rt.phase,
            "model": rt.info.model_id if rt.info else "-",
            "backend": f"{rt.info.backend} on {rt.info.device}" if rt.info else "-",
            "open streams": rt.scheduler.n_requests,
            "in-flight tokens": rt.scheduler.inflight_tokens,
            "tokens extracted": int(rt.metrics.get("eagle3_tokens_extracted_total")),
        }
        cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows.items())
        return HTMLResponse(
            f"<!doctype html><title>eagle3 serve</title><h1>eagle3 serve</h1><table>{cells}</table>"
            '<p><a href="/metrics">metrics</a> · <a href="/v1/info">info</a></p>'
        )

    @app.post("/v1/extract")
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
            rt.metrics.inc("eagle3_rejections_total", reason="overloaded")
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
