"""The interactive lane: small requests get a forward pass of their own, ahead of bulk work.

A request of at most ``interactive_max_tokens`` tokens (``--interactive-max-tokens``, 0 turns the
lane off) is *interactive*; every other one is *bulk*. When the scheduler packs the next forward
pass (``Scheduler.pick_batch``) and some interactive request is eligible, the pass holds interactive
samples only (packed by the usual rule: least-served tenant first, FIFO within a tenant, at most
``max_batch_tokens``). Such a pass is as short as its few tokens, so a notebook's 1-sample request
that arrives while a bulk job fills every pass waits for the pass in flight and then its own short
one: its time to first sample stays under about one full forward pass instead of up to two (the
pass in flight, then a full pass it shares with bulk samples).

The lane stays within the fairness rules (server/scheduler.py): every lane pass is charged its
backend time (its tokens and its share of a pass's fixed time, server/pass_cost.py) to its tenants'
fairness clocks, and a request is eligible only while its tenant's clock is at most ``slack_tokens``
(one forward pass of token-equivalents) ahead of the floor (the least clock of the active tenants);
the scheduler also runs an ordinary pass after ``MAX_LANE_STREAK`` lane passes in
a row while bulk work waits. A tenant that floods the server with small requests, or keeps a few in
flight in closed loops, is soon that far ahead: a tenant that goes idle keeps its clock (it comes back
at ``max(own, floor)``, never reset down to the floor), and its requests then wait for ordinary passes,
where the least clock goes first. A notebook that asks now and then comes back at the floor and is
eligible at once. A tenant's small request may overtake its own older bulk request (FIFO holds within
a lane).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

INTERACTIVE = "interactive"
BULK = "bulk"
LANES = (INTERACTIVE, BULK)


class Queued(Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def lane(self) -> str: ...


R = TypeVar("R", bound=Queued)


def lane_of(n_tokens: int, interactive_max_tokens: int) -> str:
    """The lane of a request of ``n_tokens`` tokens."""
    return INTERACTIVE if 0 < n_tokens <= interactive_max_tokens else BULK


def lane_requests(
    requests: Sequence[R],
    served: Mapping[str, float],
    active: set[str],
    schedulable: Callable[[R], bool],
    slack_tokens: float,
) -> list[R]:
    """The interactive requests eligible for a lane pass now (in FIFO order; empty: an ordinary pass).
    ``active``: tenants with work that could run now (not one whose output buffers are full); ``served``:
    each tenant's fairness clock (token-equivalents)."""
    if not active:
        return []
    floor = min(served.get(t, 0) for t in active)
    return [
        r
        for r in requests
        if r.lane == INTERACTIVE and served.get(r.tenant, 0) <= floor + slack_tokens and schedulable(r)
    ]
