"""Anonymous tenants (a server without API keys): names from ``X-Eagle3-Tenant``, bounded in number.

Without keys a tenant is whatever the caller says, so the names are the caller's to invent: each one
would add series to ``/metrics`` and rows to the status page forever. ``AnonymousTenants`` keeps at
most ``--max-anonymous-tenants`` names, least recently seen first; a new name beyond that forgets the
least recently seen *idle* one (nothing in flight, no open request): its series, its recent errors
and its fairness clock go. When every kept name is busy the new one is refused (429
``too_many_tenants``), and nothing else is. Names starting with ``_`` are the server's own
(``_warmup``) and refused (``deps.py``). Anonymous mode has no identity: a caller may send another
tenant's name and share its quota and its turn; isolation needs keys (docs/reliability.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from eagle3.server.errors import ApiError


class AnonymousTenants:
    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        self._seen: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def admit(self, tenant: str, busy: Callable[[str], bool]) -> list[str]:
        """Note ``tenant`` as seen now; returns the idle names it displaces (for the caller to forget).
        ``ApiError`` 429 when the set is full of busy names."""
        with self._lock:
            if tenant in self._seen:
                self._seen.move_to_end(tenant)
                return []
            forgotten: list[str] = []
            for old in list(self._seen):
                if len(self._seen) < self.max_tenants:
                    break
                if not busy(old):
                    del self._seen[old]
                    forgotten.append(old)
            if len(self._seen) >= self.max_tenants:
                raise ApiError(
                    429,
                    f"{len(self._seen)} anonymous tenants are busy (--max-anonymous-tenants "
                    f"{self.max_tenants}); retry later, or send the X-Eagle3-Tenant of one of them",
                    reason="too_many_tenants",
                    retry_after_s=5,
                    param="X-Eagle3-Tenant",
                )
            self._seen[tenant] = None
            return forgotten

    def __len__(self) -> int:
        return len(self._seen)
