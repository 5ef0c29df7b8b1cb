"""Run the app under uvicorn with eagle3's own signal handling (see server/cli.py for the behaviour).

Exit is bounded: the first SIGTERM/SIGINT drains (``Runtime.drain``: at most ``drain_timeout_s`` +
``ABORT_GRACE_S``), then uvicorn closes connections (``timeout_graceful_shutdown``) and the lifespan
stops the runtime; if the process is still up ``SHUTDOWN_GRACE_S`` after the drain ended, a watchdog
kills its child processes and exits 1. A second SIGTERM/SIGINT at any point does the same at once
(status 128 + signal number).

A load failure that no restart can cure (a configuration error: ``Runtime.exit_status``, see
``retry_could_cure`` in server/load_checks.py) shuts the server down and exits with status 2, as ``vllm
serve`` does on bad arguments; any other load failure keeps the process up, ``failed`` on /readyz.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, NoReturn

import uvicorn

from eagle3.server.app import create_app
from eagle3.server.config import ServerSettings
from eagle3.server.header_timeout import header_timeout_protocol
from eagle3.server.metrics import package_version
from eagle3.server.request_log import configure_logging

logger = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 30.0  # after the drain: the most the rest of shutdown may take
GRACEFUL_CLOSE_S = 5  # uvicorn's wait for open connections after the drain


def hard_exit(status: int, why: str) -> NoReturn:
    """Kill child processes (engine workers) and leave now, without the interpreter's cleanup."""
    print(f"eagle3 serve: {why}; exiting now", file=sys.stderr, flush=True)  # noqa: T201
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(status)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once, and which prints
    the bound address as soon as the socket listens."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.app = app
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"eagle3 serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)  # noqa: T201

    async def on_tick(self, counter: int) -> bool:
        runtime = getattr(self.app.state, "runtime", None)
        if runtime is not None and runtime.exit_status is not None:
            return True  # a configuration error: shut down (serve() then exits with its status)
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: ARG002 (uvicorn's signature)
        # Not recorded in _captured_signals: uvicorn would re-raise it on exit and the status would be -15.
        if self.draining:
            hard_exit(128 + sig, f"second {signal.Signals(sig).name} while shutting down")
        self.draining = True
        if self.loop is None:  # not started yet: nothing to drain
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        runtime = getattr(self.app.state, "runtime", None)
        clean = True
        if runtime is not None:
            clean = await runtime.drain()
        watchdog = threading.Timer(
            SHUTDOWN_GRACE_S, hard_exit, (1, f"shutdown still running {SHUTDOWN_GRACE_S:.0f} s after the drain")
        )
        watchdog.daemon = True
        watchdog.start()
        logger.info("drain %s; shutting down", "complete" if clean else "timed out (open streams aborted)")
        self.should_exit = True


def uvicorn_config(settings: ServerSettings, app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=header_timeout_protocol(settings.header_timeout_s),  # server/header_timeout.py
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        lifespan="on",
        log_config=None,
        access_log=False,  # eagle3.server.request_log writes one line per call, probes excluded
    )


def serve(settings: ServerSettings) -> int:
    """Serve until drained; the exit status (0, or 2 after a load failure no restart can cure)."""
    configure_logging(settings.log_level, settings.log_format)
    effective = settings.effective()
    logger.info(
        "eagle3 %s serve; settings not at their default: %s",
        package_version(),
        ", ".join(f"{k}={v}" for k, v in effective.items()) or "none",
        extra={"fields": {"settings": effective}},  # --log-format json: one object, not a string to parse
    )
    app = create_app(settings, freeze_gc_when_ready=True)  # this process lives exactly as long as the app
    DrainingServer(uvicorn_config(settings, app), app).run()
    runtime = app.state.runtime
    if runtime.exit_status is not None:
        print(f"eagle3 serve: error: {runtime.error}", file=sys.stderr, flush=True)  # noqa: T201
        return int(runtime.exit_status)
    return 0
