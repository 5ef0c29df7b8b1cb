"""What ``/openapi.json`` says beyond what FastAPI derives, and who may read it.

``/openapi.json`` needs an API key like every route but the probes, unless ``--public-openapi``. There
is no Swagger UI (``/docs``): FastAPI's loads its script from a public CDN at a floating version,
which a server without internet cannot reach and a pinned deployment should not run; any OpenAPI
viewer reads the JSON (``curl -H 'Authorization: Bearer KEY' .../openapi.json``).

``/v1/extract`` reads its body itself (a byte limit before parsing, then ``validation.ExtractRequest``),
so its request schema is declared here from that same pydantic model, and its 200 response is the
binary frame stream of docs/protocol.md rather than JSON.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from eagle3.core.protocol.frames import CONTENT_TYPE
from eagle3.server.deps import authenticate_unless
from eagle3.server.validation import ExtractRequest


def _error(description: str) -> dict[str, Any]:
    return {"description": description + " (JSON error envelope: {error: {type, message, reason, param}})"}


EXTRACT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ExtractRequest"}}},
    },
    "responses": {
        "200": {
            "description": "HEADER, DATA / SAMPLE_ERROR / HEARTBEAT, then END or ERROR frames (docs/protocol.md)",
            "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
        "400": _error("invalid request, ids out of range, over --max-request-tokens"),
        "401": _error("missing or invalid API key"),
        "413": _error("body over --max-body-mb"),
        "429": _error("the tenant's in-flight quota is full; Retry-After"),
        "503": _error("loading, draining, failed or overloaded; Retry-After"),
    },
}


def install_openapi(app: FastAPI) -> None:
    """Add the request models ``EXTRACT_OPENAPI`` refers to under ``components/schemas``, and the route
    ``/openapi.json`` behind the key (the app is made with ``openapi_url=None, docs_url=None``)."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            top = ExtractRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(top.pop("$defs", {}))
            components["ExtractRequest"] = top
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(authenticate_unless("public_openapi"))])
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())
