"""The routes, as module-level handlers on two routers: ``probes`` (``/livez``, ``/readyz``: no key, for
the orchestrator) and ``api`` (everything else: the API key, unless a ``--public-*`` setting opens a
read-only page). They hold no state: each reads the ``Runtime`` the app's lifespan created."""

from __future__ import annotations

import functools
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from eagle3.core.protocol.features import DTYPE_FP8
from eagle3.server.admission import admit
from eagle3.server.deps import authenticate, runtime_of, unavailable, viewer_unless
from eagle3.server.errors import ApiError
from eagle3.server.generate import GENERATE_OPENAPI, handle_generate
from eagle3.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from eagle3.server.openapi import EXTRACT_OPENAPI
from eagle3.server.request_limits import check_content_type
from eagle3.server.runtime import Runtime
from eagle3.server.status_page import render_status_page, status_data
from eagle3.server.stream import ExtractStream, FrameStreamResponse
from eagle3.server.units import Sample
from eagle3.server.validation import ExtractRequest, check_samples, parse_request
from eagle3.server.visibility import Viewer, visible_metrics, visible_status

probes = APIRouter()
api = APIRouter()
METRICS_VIEWER = Depends(viewer_unless("public_metrics"))  # who looks: server/visibility.py
STATUS_VIEWER = Depends(viewer_unless("public_status"))


@probes.get("/livez")
async def livez() -> dict[str, str]:
    return {"status": "alive"}


@probes.get("/readyz")
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


@api.get("/v1/info", dependencies=[Depends(authenticate)])
async def info(request: Request) -> JSONResponse:
    rt = runtime_of(request)
    if rt.info is None:
        raise unavailable(rt) or ApiError(503, "model is loading", reason="loading", retry_after_s=5)
    return JSONResponse(rt.describe().to_dict())


@api.get("/metrics", include_in_schema=False)
async def metrics(request: Request, viewer: Viewer = METRICS_VIEWER) -> Response:
    """Every tenant's series for an admin key (or ``--public-metrics``), the caller's own for a plain key."""
    rt = runtime_of(request)
    body = visible_metrics(rt.metrics.registry, viewer) + rt.metrics.process_exposition()  # the latter: no tenant
    return Response(body, media_type=METRICS_CONTENT_TYPE)


@api.get("/v1/status")
async def status_json(request: Request, viewer: Viewer = STATUS_VIEWER) -> JSONResponse:
    """The status page's figures: model, load phase, uptime, per-tenant work, throughput, recent errors
    (other tenants' rows and errors only for an admin key; server/visibility.py)."""
    rt = runtime_of(request)
    return JSONResponse(visible_status(status_data(rt), viewer, rt.settings.public_status))


@api.get("/", include_in_schema=False)
async def status_page(request: Request, viewer: Viewer = STATUS_VIEWER) -> HTMLResponse:
    rt = runtime_of(request)
    return HTMLResponse(render_status_page(visible_status(status_data(rt), viewer, rt.settings.public_status)))


@api.post("/v1/extract", openapi_extra=EXTRACT_OPENAPI)
async def extract(request: Request, tenant: str = Depends(authenticate)) -> Response:
    rt = runtime_of(request)
    if (err := unavailable(rt)) is not None:
        raise err
    assert rt.info is not None
    check_content_type(request)
    rt.connections.acquire(tenant)  # released when the response ends, whatever happens from here
    try:
        return await _extract(request, tenant, rt)
    except BaseException:
        rt.connections.release(tenant)
        raise


async def _extract(request: Request, tenant: str, rt: Runtime) -> Response:
    assert rt.info is not None
    info, settings = rt.info, rt.settings
    check = functools.partial(
        check_samples,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_tokens=settings.request_token_cap,
        chat=rt.chat,
        chat_limits=rt.chat_limits,
    )
    request_id = request.state.request_id

    def open_stream(parsed: ExtractRequest, samples: list[Sample]) -> ExtractStream:
        codec = rt.codec_for(parsed.codec or settings.default_codec, request.client.host if request.client else None)
        return rt.open_stream(
            request_id,
            tenant,
            samples,
            codec,
            parsed.zstd_level,
            use_cache=parsed.cache == "use",
            fp8=parsed.dtype == DTYPE_FP8,
        )

    stream = await admit(request, tenant, rt, parse_request, check, open_stream)
    if stream is None:
        rt.connections.release(tenant)
        return Response(status_code=400)  # the client left during the upload: nobody reads it
    headers = {"X-Request-Id": request_id, "Cache-Control": "no-store"}
    return FrameStreamResponse(stream, headers=headers, on_close=lambda: rt.connections.release(tenant))


@api.post("/v1/generate", openapi_extra=GENERATE_OPENAPI)
async def generate(request: Request, tenant: str = Depends(authenticate)) -> Response:
    """The verifier's replies to prompts (core/protocol/generate.py; docs/protocol.md, "Generation")."""
    rt = runtime_of(request)
    if (err := unavailable(rt)) is not None:
        raise err
    check_content_type(request)
    rt.connections.acquire(tenant)  # the same per-tenant cap as extract streams
    try:
        return await handle_generate(request, tenant, rt)
    finally:
        rt.connections.release(tenant)
