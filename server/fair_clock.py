"""The fairness clock: start-time fair queuing's bookkeeping, per tenant, in token-equivalents.

The scheduler (server/scheduler.py) owns one and calls it with its condition held; nothing here locks.

* ``clock[tenant]``: the work charged to the tenant. When a unit is picked it is charged its reserved
  tokens (``pick``); after its pass the charge is corrected to what it cost (``charge``: server/pass_cost.py).
  The next unit of a pass goes to the tenant with the least clock (``least``).
* ``floor``: the least clock of the active tenants (those with work that could run now), never decreasing:
  the virtual time (``advance``).
* A tenant that becomes active (a new request, or room again in a full output buffer) gets
  ``max(own clock, floor)`` (``become_active``): it does not bank the time it was idle, and a tenant that goes
  idle after every pass (a closed-loop client) comes back where it left, not level with the floor.
* ``served[tenant]``: the tokens it had processed (extracted, prompts + generated), for its counters and tests;
  corrected after the pass by what the unit used.

tests/unit/test_scheduler_fairness.py drives these rules through the scheduler with closed-loop clients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class FairClock:
    def __init__(self) -> None:
        self.clock: dict[str, float] = {}  # tenant -> work charged, token-equivalents
        self.floor = 0.0  # the least clock of the active tenants, never decreasing (the virtual time)
        self.served: dict[str, int] = {}  # tenant -> tokens processed

    def advance(self, active: Iterable[str]) -> float:
        """The virtual time, given the tenants with work that could run now."""
        clocks = [self.clock.get(t, self.floor) for t in active]
        if clocks:
            self.floor = max(self.floor, min(clocks))
        return self.floor

    def become_active(self, tenant: str, active: Iterable[str]) -> None:
        """``tenant`` has work that can run again: ``max(own clock, floor)``, never reset down."""
        floor = self.advance(active)
        self.clock[tenant] = max(self.clock.get(tenant, floor), floor)

    def least(self, tenants: Iterable[str]) -> str:
        """The tenant that goes next: the least clock (the first of equals, in ``tenants``' order)."""
        return min(tenants, key=lambda t: self.clock.get(t, 0.0))

    def pick(self, tenant: str, n_tokens: int) -> None:
        """A unit of ``n_tokens`` reserved tokens was packed: charge them now, corrected by ``charge``."""
        self.served[tenant] = self.served.get(tenant, 0) + n_tokens
        self.clock[tenant] = self.clock.get(tenant, 0.0) + n_tokens

    def charge(self, tenant: str, n_tokens: int, cost: float, used_tokens: int | None) -> None:
        """After the pass: the clock keeps what the unit cost, ``served`` what it processed."""
        if tenant in self.clock:
            self.clock[tenant] += cost - n_tokens
        if used_tokens is not None and tenant in self.served:
            self.served[tenant] -= n_tokens - used_tokens

    def closed(self, tenant: str, still_open: bool) -> None:
        """A request of ``tenant`` closed. A tenant with no open request whose clock is at the floor would
        come back at the floor anyway: its entry goes, so the table stays bounded by the open tenants."""
        if not still_open and self.clock.get(tenant, math.inf) <= self.floor:
            del self.clock[tenant]

    def forget(self, tenant: str) -> None:
        """Drop every trace of ``tenant`` (the warm-up's tenant, which has no open request)."""
        self.served.pop(tenant, None)
        self.clock.pop(tenant, None)
