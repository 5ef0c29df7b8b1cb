"""Run the app under uvicorn with eagle3's own signal handling (see server/cli.py for the behaviour)."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import uvicorn

from server.app import create_app
from server.config import ServerSettings


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

    def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: ARG002 (uvicorn's signature)
        # Not recorded in _captured_signals: uvicorn would re-raise it on exit and the status would be -15.
        if self.draining or self.loop is None:
            self.should_exit = True
            self.force_exit = self.draining
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        runtime = getattr(self.app.state, "runtime", None)
        if runtime is not None:
            await runtime.drain()
        self.should_exit = True


def serve(settings: ServerSettings) -> None:
    logging.getLogger().setLevel(settings.log_level.upper())
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
        log_config=None,
    )
    DrainingServer(config, app).run()
