"""``--header-timeout-s``: a connection that has not sent a whole request's headers in time is closed.

uvicorn (0.55) bounds how *large* headers may be (``h11_max_incomplete_event_size``) and how long an
idle keep-alive connection stays (``timeout_keep_alive``, cancelled by the first byte that arrives),
but not how long headers may take: a client sending a header line every few seconds holds its socket
forever, unauthenticated, since the API key is read only once the headers are complete.

``header_timeout_protocol(timeout_s)`` is uvicorn's own HTTP protocol class (httptools when
installed, else h11: what ``http="auto"`` picks) with one timer: armed when the connection opens and
again when a response ends, it closes the connection when it fires while no request is in progress,
that is when the next request's headers have not all arrived within ``timeout_s``. A request whose
headers are complete is bounded by the app instead (``--body-timeout-s``, the stream's own limits).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)


def header_timeout_protocol(timeout_s: float, base: type[Any] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
    """``base`` (a uvicorn HTTP protocol class) closing connections whose headers take over ``timeout_s``."""

    class HeaderTimeoutProtocol(base):  # type: ignore[misc]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = None
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            cycle = getattr(self, "cycle", None)
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                logger.info(
                    "closed a connection from %s: no complete request headers within %g s (--header-timeout-s)",
                    f"{self.client[0]}:{self.client[1]}" if self.client else "?",
                    timeout_s,
                )
                self.transport.close()

    return HeaderTimeoutProtocol
