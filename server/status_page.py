"""The read-only status page (``GET /``) and its data (``GET /v1/status``).

What a person sharing the server wants at a glance: the model, the load phase, uptime, per-tenant
work in flight and totals, throughput over the last minutes and the last errors. Every figure comes
from the same ``Metrics`` registry and scheduler gauges that ``/metrics`` exposes, so the page and a
scrape taken at the same moment agree (tests/e2e/test_status_page.py checks that in headless
Chromium). Nothing secret is shown: no keys, no sample contents, no settings beyond the model's
identity; which tenants' rows and error texts a caller sees is ``server/visibility.py``'s.
Server-side HTML with a meta refresh (no JavaScript, no assets): it renders the same in a browser,
``curl`` or a terminal browser, and needs no key in the page when ``--public-status``.
"""

from __future__ import annotations

import html
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.server.runtime import Runtime

WINDOWS_S = (60, 300, 900)
REFRESH_S = 5


def status_data(rt: Runtime) -> dict[str, Any]:
    """The page's figures as JSON (``/v1/status``)."""
    info, m, sched = rt.info, rt.metrics, rt.scheduler
    totals = m.snapshot()
    inflight = dict(sched.tenant_inflight)
    queued = sched.queue_depth()
    names = sorted(set(totals) | set(inflight) | set(queued))
    tenants = [
        {
            "tenant": t,
            "inflight_tokens": inflight.get(t, 0),
            "queued_samples": queued.get(t, 0),
            "requests": int(totals.get(t, {}).get("requests", 0)),
            "tokens": int(totals.get(t, {}).get("tokens", 0)),
            "bytes": int(totals.get(t, {}).get("bytes", 0)),
            "rejections": int(totals.get(t, {}).get("rejections", 0)),
        }
        for t in names
    ]
    return {
        "model_id": info.model_id if info else None,
        "revision": info.revision if info else None,
        "backend": info.backend if info else None,
        "device": info.device if info else None,
        "status": rt.status,
        "phase": rt.phase,
        "progress": rt.progress,
        "uptime_s": round(time.monotonic() - m.started, 1),
        "load_time_s": round(m.load_time_s, 1),
        "inflight_tokens": sched.inflight_tokens,
        "active_requests": sched.n_requests,
        "tokens_extracted": int(m.get("eagle3_tokens_extracted_total")),
        "throughput_tok_s": {f"{w // 60}m": round(m.throughput_tok_s(w), 1) for w in WINDOWS_S},
        "throughput_history": [[round(ago, 1), round(rate, 1)] for ago, rate in m.throughput_history()],
        "tenants": tenants,
        "recent_errors": [
            {
                "at": datetime.fromtimestamp(e.at_unix_s, UTC).isoformat(timespec="seconds"),
                "kind": e.kind,
                "tenant": e.tenant,
                "request_id": e.request_id,
                "message": e.message,
            }
            for e in reversed(m.errors)
        ],
    }


def _duration(seconds: float) -> str:
    s = int(seconds)
    return (
        f"{s // 86400}d {s % 86400 // 3600}h {s % 3600 // 60}m"
        if s >= 86400
        else f"{s // 3600}h {s % 3600 // 60}m {s % 60}s"
    )


def _cell(value: object, metric: str | None = None, numeric: bool = False) -> str:
    """A table cell; ``metric`` names the /metrics series it shows (``data-metric``)."""
    text = f"{value:,}" if numeric and isinstance(value, int) else str(value)
    attr = f' data-metric="{html.escape(metric)}"' if metric else ""
    cls = ' class="n"' if numeric else ""
    return f"<td{cls}{attr}>{html.escape(text)}</td>"


def _sparkline(history: list[list[float]], width: int = 600, height: int = 80) -> str:
    """One bar per 10 s bucket of the last 15 minutes (a lone bucket still shows)."""
    if not history:
        return '<p class="muted">no tokens extracted in the last 15 minutes</p>'
    peak = max(rate for _, rate in history) or 1.0
    bar_w = width / 90
    bars = "".join(
        f'<rect x="{max(0.0, width - ago / 900 * width - bar_w):.1f}" y="{height - rate / peak * height:.1f}" '
        f'width="{bar_w:.1f}" height="{rate / peak * height:.1f}" fill="#2a6"/>'
        for ago, rate in history
    )
    return (
        f'<svg width="{width}" height="{height}" role="img" aria-label="tokens/s, last 15 minutes" '
        f'style="border-bottom: 1px solid #ccc">{bars}</svg>'
        f'<p class="muted">tokens/s per 10 s over the last 15 minutes (peak {peak:,.0f})</p>'
    )


def render_status_page(data: dict[str, Any], metrics_path: str = "/metrics") -> str:
    rows = [
        ("model", data["model_id"] or "-", None),
        ("revision", (data["revision"] or "-")[:12], None),
        ("backend", f"{data['backend']} on {data['device']}" if data["backend"] else "-", None),
        ("status", data["status"], None),
        ("phase", f"{data['phase']} ({data['progress']:.0%})", None),
        ("uptime", _duration(data["uptime_s"]), None),
        ("load time", f"{data['load_time_s']:.1f} s", None),
        ("open streams", data["active_requests"], "eagle3_active_requests"),
        ("in-flight tokens", data["inflight_tokens"], "eagle3_inflight_tokens"),
        ("tokens extracted", data["tokens_extracted"], "eagle3_tokens_extracted_total"),
    ]
    rows += [(f"tokens/s, last {k}", v, None) for k, v in data["throughput_tok_s"].items()]
    summary = "".join(
        f"<tr><th>{html.escape(k)}</th>{_cell(v, metric, isinstance(v, int))}</tr>" for k, v, metric in rows
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "tenant",
            "in-flight tokens",
            "queued samples",
            "requests",
            "tokens",
            "bytes sent",
            "rejections",
        )
    )
    tenant_rows = []
    for t in data["tenants"]:
        label = 'tenant="' + t["tenant"].replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        tenant_rows.append(
            f"<tr><td>{html.escape(t['tenant'])}</td>"
            + _cell(t["inflight_tokens"], f"eagle3_tenant_inflight_tokens{{{label}}}", True)
            + _cell(t["queued_samples"], f"eagle3_queue_samples{{{label}}}", True)
            + _cell(t["requests"], f"eagle3_requests_total{{{label}}}", True)
            + _cell(t["tokens"], f"eagle3_tokens_extracted_total{{{label}}}", True)
            + _cell(t["bytes"], f'eagle3_stream_bytes_total{{{label},kind="wire"}}', True)
            + _cell(t["rejections"], f"eagle3_rejections_total{{{label}}}", True)
            + "</tr>"
        )
    tenants = "".join(tenant_rows) or '<tr><td colspan="7" class="muted">no tenant yet</td></tr>'
    errors = (
        "".join(
            f"<tr><td>{html.escape(e['at'])}</td><td>{html.escape(e['kind'])}</td><td>{html.escape(e['tenant'])}</td>"
            f"<td>{html.escape(e['request_id'])}</td><td>{html.escape(e['message'])}</td></tr>"
            for e in data["recent_errors"]
        )
        or '<tr><td colspan="5" class="muted">none</td></tr>'
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>eagle3 serve: {html.escape(str(data["model_id"] or data["status"]))}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.muted {{ color: #777; }}
</style></head><body>
<h1>eagle3 serve</h1>
<table id="summary">{summary}</table>
<h2>Throughput</h2>{_sparkline(data["throughput_history"])}
<h2>Tenants</h2>
<table id="tenants"><tr>{head}</tr>{tenants}</table>
<h2>Recent errors</h2>
<table id="errors"><tr><th>at (UTC)</th><th>kind</th><th>tenant</th><th>request id</th><th>message</th></tr>
{errors}</table>
<p class="muted">Refreshes every {REFRESH_S} s.
<a href="{metrics_path}">/metrics</a> · <a href="/v1/status">/v1/status</a> · <a href="/openapi.json">OpenAPI</a></p>
</body></html>
"""
