"""Who sees what of a shared server (docs/reliability.md, "Isolation").

A ``Viewer`` is resolved per call of ``/``, ``/v1/status`` and ``/metrics``:

* an **admin** (a key of a tenant named by ``--admin-tenant``), or any caller of a server without keys
  (anonymous mode: a tenant is whatever ``X-Eagle3-Tenant`` says, so there is nobody to isolate),
  sees every tenant's rows, error messages and the feature cache's counters;
* a **plain key** sees its own tenant's rows and errors, the server-wide figures (throughput, totals,
  load), and no cache counter (in a shared cache a hit tells that *someone* extracted that text);
* **no key** where ``--public-status`` (or ``--public-metrics``) opens the page: every tenant's rows,
  but an error shows only its time, kind and tenant (messages carry sample ids, and ids can be
  content; request ids are the client's); a plain key on a public page sees its own errors whole.

``/metrics`` for a plain key is the same registry filtered here at scrape time (samples labelled with
another tenant and ``eagle3_cache_*`` families left out), so the registry itself knows no viewers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

REDACTED = "(redacted: only the tenant's own key or an admin key sees error messages)"
CACHE_PREFIX = "eagle3_cache_"


@dataclass(frozen=True)
class Viewer:
    tenant: str | None  # the caller's tenant; None: no key, on a page opened by a --public-* setting
    sees_all: bool  # an admin key, or a server without keys

    def sees_tenant(self, tenant: str, public: bool) -> bool:
        """Whether ``tenant``'s row is shown (``public``: the page is open to everyone)."""
        return self.sees_all or public or tenant == self.tenant

    def sees_error_text(self, tenant: str) -> bool:
        return self.sees_all or tenant == self.tenant


def visible_status(data: dict[str, Any], viewer: Viewer, public: bool) -> dict[str, Any]:
    """``status_data``'s figures as ``viewer`` may see them (``public``: ``--public-status``)."""
    if viewer.sees_all:
        return data
    errors = []
    for e in data["recent_errors"]:
        if viewer.sees_error_text(e["tenant"]):
            errors.append(e)
        elif public:
            errors.append({**e, "request_id": "-", "message": REDACTED})
    tenants = [t for t in data["tenants"] if viewer.sees_tenant(t["tenant"], public)]
    return {**data, "tenants": tenants, "recent_errors": errors}


class _TenantView(Collector):
    """``registry``'s families without other tenants' samples and without the cache's families."""

    def __init__(self, registry: Collector, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name.startswith(CACHE_PREFIX):
                continue
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.labels.get("tenant", self.tenant) == self.tenant]
            yield kept


def visible_metrics(registry: Collector, viewer: Viewer) -> bytes:
    """The Prometheus exposition of ``registry`` as ``viewer`` may see it."""
    if viewer.sees_all or viewer.tenant is None:
        return generate_latest(registry)
    return generate_latest(_TenantView(registry, viewer.tenant))
