"""The server's logs: one line per finished extract request, one per other API call (probes and
scrapes excluded), and the format of every line (``--log-format text|json``).

JSON lines (``eagle3.core.json_log.JsonFormatter``, the same for vLLM's loggers with the vllm backend)
carry ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` and, for request lines, the fields of the
request as top-level keys (``request_id``, ``tenant``, ``samples``, ``failed``, ``tokens``, ``bytes``,
``duration_s``, ``outcome``): what a log pipeline indexes without a regex. The status page (``/``, which
a browser reloads every 5 s) and ``/v1/status`` are logged at debug only, like scrapes.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any, Protocol

from eagle3.core.json_log import JsonFormatter

request_logger = logging.getLogger("eagle3.server.requests")
QUIET_PATHS = frozenset({"/livez", "/readyz"})  # probes: never logged
# debug only: a scrape every 15 s, the status page's refresh every 5 s (and its JSON twin) would be noise
SCRAPE_PATHS = frozenset({"/metrics", "/", "/v1/status"})
WARMUP_TENANT = "_warmup"
PLAIN_RE = re.compile(r"^[A-Za-z0-9_.:/-]+$")


class _Req(Protocol):
    request_id: str
    tenant: str
    admitted_at: float


def log_finished_request(req: _Req, counts: dict[str, int], outcome: str) -> None:
    """One line per finished ``/v1/extract`` stream (warm-up requests only at debug level)."""
    fields: dict[str, Any] = {
        "request_id": req.request_id,
        "tenant": req.tenant,
        "samples": counts["n_samples"],
        "failed": counts["n_failed"],
        "tokens": counts["n_tokens"],
        "bytes": counts["payload_bytes"],
        "duration_s": round(time.monotonic() - req.admitted_at, 3),
        "outcome": outcome,
    }
    level = logging.DEBUG if req.tenant == WARMUP_TENANT else logging.INFO
    text = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
    request_logger.log(level, "extract finished %s", text, extra={"fields": fields})


def _value(v: object) -> str:
    """Plain when safe, else JSON-quoted: a tenant name cannot forge a second log line or field."""
    return v if isinstance(v, str) and PLAIN_RE.match(v) else json.dumps(v) if isinstance(v, str) else str(v)


def log_api_call(method: str, path: str, status: int, duration_s: float, request_id: str) -> None:
    """One line per answered API call other than ``/v1/extract`` streams and probes."""
    if path in QUIET_PATHS:
        return
    level = logging.DEBUG if path in SCRAPE_PATHS else logging.INFO
    fields = {
        "request_id": request_id,
        "method": method,
        "path": path,
        "status": status,
        "duration_s": round(duration_s, 4),
    }
    request_logger.log(level, "%s %s %d %.1f ms", method, path, status, duration_s * 1000, extra={"fields": fields})


def configure_logging(level: str, log_format: str) -> None:
    """The root logger's level and, for ``json``, its handlers' format (uvicorn's loggers propagate
    to it: ``serve`` runs uvicorn with ``log_config=None`` and its access log off)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not root.handlers:
        logging.basicConfig(level=level.upper())
    if log_format == "json":
        for handler in root.handlers:
            handler.setFormatter(JsonFormatter())
