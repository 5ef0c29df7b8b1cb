"""The interactive lane (server/lanes.py) with the in-memory fake backend of test_scheduler: a small
request arriving while a bulk tenant fills every pass runs in the next pass, alone; with the lane off it
shares a full pass; a tenant flooding the lane with small requests does not starve a bulk tenant."""

from __future__ import annotations

import asyncio

from eagle3.server.lanes import BULK, INTERACTIVE, lane_of
from eagle3.server.scheduler import Scheduler
from tests.unit.test_scheduler import FakeBackend, drain, samples

BULK_TAG, NOTEBOOK_TAG = 1, 2


def make(backend: FakeBackend, interactive_max_tokens: int) -> Scheduler:
    sched = Scheduler(
        backend.extract,
        max_batch_tokens=40,
        max_inflight_tokens=100_000,
        max_tenant_inflight_tokens=50_000,
        interactive_max_tokens=interactive_max_tokens,
    )
    sched.start()
    return sched


def calls_with(backend: FakeBackend, tag: int) -> list[int]:
    return [k for k, call in enumerate(backend.calls) if any(ids[0] // 1000 == tag for ids in call)]


def notebook_while_bulk_runs(interactive_max_tokens: int) -> tuple[FakeBackend, int]:
    """A bulk tenant (200 samples of 10 tokens: every pass full) and, after a few passes, a notebook's
    1-sample request of 6 tokens. Returns the backend and how many calls had started when it arrived."""
    backend = FakeBackend(delay_s=0.01)
    sched = make(backend, interactive_max_tokens)

    async def main() -> int:
        bulk = sched.submit("bulk", "ci", samples(BULK_TAG, [10] * 200))
        reader = asyncio.create_task(drain(sched, bulk, []))
        while len(backend.calls) < 5:
            await asyncio.sleep(0.002)
        arrived_at_call = len(backend.calls)
        notebook = sched.submit("nb", "notebook", samples(NOTEBOOK_TAG, [6]))
        assert notebook.lane == lane_of(6, interactive_max_tokens)
        await drain(sched, notebook, [])
        await reader
        return arrived_at_call

    arrived = asyncio.run(main())
    sched.stop()
    assert sched.inflight_tokens == 0
    return backend, arrived


def test_a_small_request_runs_alone_in_the_next_pass_while_bulk_fills_every_pass() -> None:
    backend, arrived = notebook_while_bulk_runs(interactive_max_tokens=32)
    (k,) = calls_with(backend, NOTEBOOK_TAG)
    assert backend.calls[k] == [[NOTEBOOK_TAG * 1000] * 6], "the lane pass holds the notebook's sample only"
    assert k <= arrived, f"arrived during pass {arrived - 1}, ran in pass {k}: later than the next one"
    bulk_sizes = [sum(len(ids) for ids in call) for j, call in enumerate(backend.calls) if j != k]
    assert all(size == 40 for size in bulk_sizes), "bulk passes stay full"


def test_with_the_lane_off_the_small_request_shares_a_full_pass() -> None:
    backend, arrived = notebook_while_bulk_runs(interactive_max_tokens=0)
    (k,) = calls_with(backend, NOTEBOOK_TAG)
    assert len(backend.calls[k]) > 1, "without the lane the sample rides in a bulk pass"
    assert lane_of(6, 0) == BULK and lane_of(6, 32) == INTERACTIVE and lane_of(33, 32) == BULK


def test_a_tenant_flooding_the_lane_does_not_starve_a_bulk_tenant() -> None:
    backend = FakeBackend(delay_s=0.002)
    sched = make(backend, interactive_max_tokens=32)

    async def main() -> None:
        backend.gate.clear()  # both arrive before the first pass
        bulk = sched.submit("bulk", "bulk", samples(BULK_TAG, [10] * 100))
        small = [sched.submit(f"f{i}", "flood", samples(3, [10])) for i in range(100)]
        assert all(r.lane == INTERACTIVE for r in small) and bulk.lane == BULK
        backend.gate.set()
        await asyncio.gather(drain(sched, bulk, []), *(drain(sched, r, []) for r in small))

    asyncio.run(main())
    sched.stop()
    tenants = [ids[0] // 1000 for call in backend.calls for ids in call]
    last_flood = max(i for i, tag in enumerate(tenants) if tag == 3)
    last_bulk = max(i for i, tag in enumerate(tenants) if tag == BULK_TAG)
    window = tenants[: min(last_flood, last_bulk) + 1]  # while both had work
    share = window.count(BULK_TAG) / len(window)
    assert 0.35 <= share <= 0.65, f"bulk got {share:.0%} of the samples while both tenants had work"
