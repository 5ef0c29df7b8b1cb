"""The one JSON log line of every eagle3 process (``--log-format json``): the server's own loggers and,
with the vllm backend, vLLM's loggers in the server and in vLLM's engine and worker processes (their
``dictConfig`` names this class: server/backends/vllm_phases.py).

A line carries ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``message``, ``process`` when the record
comes from another process than the main one (vLLM's ``EngineCore_DP0``, ``Worker_TP1``, ...), an
``exception`` when there is one, and the record's ``fields`` (request lines) as top-level keys: what a
log pipeline indexes without a regex. The standard library's ``logging`` is enough (a ``Formatter``
subclass); no dependency.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line (k8s log collectors)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.processName not in ("MainProcess", None):
            out["process"] = record.processName
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def root_logs_json() -> bool:
    """Whether this process writes JSON lines (``configure_logging(..., "json")`` set the root's handlers)."""
    handlers = logging.getLogger().handlers
    return bool(handlers) and all(isinstance(h.formatter, JsonFormatter) for h in handlers)


def restyle_as_json(logger: logging.Logger) -> None:
    """Give every handler of ``logger`` the JSON formatter (a library that set up its own handlers, as
    vLLM does at import, then writes the same lines as the root)."""
    for handler in logger.handlers:
        handler.setFormatter(JsonFormatter())
