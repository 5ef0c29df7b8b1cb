"""Request dependencies shared by the routes: the app's ``Runtime``, API-key authentication and the
"not ready" answer."""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable

from fastapi import Request

from eagle3.server.config import RESERVED_TENANT_PREFIX
from eagle3.server.errors import ApiError
from eagle3.server.runtime import Runtime
from eagle3.server.tenants import AnonymousTenants
from eagle3.server.visibility import Viewer

TENANT_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def runtime_of(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def anonymous_tenants(request: Request) -> AnonymousTenants:
    """The app's bounded set of anonymous tenant names (made with the app: ``create_app``)."""
    seen: AnonymousTenants = request.app.state.anonymous_tenants
    return seen


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


def viewer_unless(public: str) -> Callable[[Request], Viewer]:
    """Who is looking (``server/visibility.py``): an admin key (or a server without keys) sees all, a
    plain key its own tenant; without an ``Authorization`` header, where the setting named ``public``
    is on, the public view; else 401."""

    def check(request: Request) -> Viewer:
        settings = runtime_of(request).settings
        if getattr(settings, public) and settings.api_keys and "authorization" not in request.headers:
            return Viewer(None, sees_all=False)
        tenant = authenticate(request)
        return Viewer(tenant, sees_all=not settings.api_keys or tenant in settings.admin_tenant)

    return check


def _authenticate(request: Request) -> str:
    rt = runtime_of(request)
    keys = rt.settings.api_keys
    if not keys:
        tenant = request.headers.get("x-eagle3-tenant", "default")
        if not TENANT_RE.match(tenant):
            raise ApiError(400, "X-Eagle3-Tenant must be 1-64 characters of [A-Za-z0-9_.:-]", param="X-Eagle3-Tenant")
        if tenant.startswith(RESERVED_TENANT_PREFIX):
            raise ApiError(
                400,
                f"X-Eagle3-Tenant {tenant!r}: names starting with '_' are reserved for the server's own work",
                param="X-Eagle3-Tenant",
            )

        def busy(name: str) -> bool:
            return bool(rt.scheduler.tenant_inflight.get(name)) or rt.connections.open(name) > 0

        for idle in anonymous_tenants(request).admit(tenant, busy):
            rt.metrics.forget_tenant(idle)  # server/tenants.py: its series, errors and fairness clock go
            rt.scheduler.forget_tenant(idle)
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
