"""Scheduler behaviour with an in-memory fake backend: fairness, token budget, cancellation, slow readers."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from eagle3.server.request_state import AdmissionError, Request
from eagle3.server.scheduler import Scheduler
from eagle3.server.units import Sample


class FakeBackend:
    """Returns each sample's ids as its 'states'; records every call; can be held shut by a gate."""

    def __init__(self, delay_s: float = 0.001, fail_id: int | None = None) -> None:
        self.calls: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.delay_s = delay_s
        self.fail_id = fail_id

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Any]:
        self.gate.wait()
        self.calls.append([list(ids) for ids in batch])
        time.sleep(self.delay_s)
        if self.fail_id is not None and any(self.fail_id in ids for ids in batch):
            raise RuntimeError("injected failure")
        return [list(ids) for ids in batch]


def samples(tag: int, lengths: Sequence[int]) -> list[Sample]:
    """Sample i's ids are all ``tag * 1000 + i`` (so a call's contents identify request and sample)."""
    return [Sample(i, f"s{i}", [tag * 1000 + i] * n, [0] * n) for i, n in enumerate(lengths)]


def make(backend: FakeBackend, **kwargs: int) -> Scheduler:
    opts = {"max_batch_tokens": 40, "max_inflight_tokens": 100_000, "max_tenant_inflight_tokens": 50_000, **kwargs}
    sched = Scheduler(backend.extract, **opts)  # type: ignore[arg-type]
    sched.start()
    return sched


async def drain(sched: Scheduler, req: Request, log: list[tuple[str, int]], stop_after: int | None = None) -> None:
    """Read a request like the stream does: take results, mark consumed, release budget, close."""
    done = 0
    try:
        while done < len(req.samples):
            for result in await req.next_results(timeout_s=5.0):
                log.append((req.tenant, result.sample.index))
                sched.consumed(req, result)
                sched.release(req, result.sample.n_tokens)
                done += 1
            if stop_after is not None and done >= stop_after:
                return
    finally:
        sched.close(req)


def test_small_tenant_finishes_while_large_one_streams() -> None:
    backend = FakeBackend()
    sched = make(backend)

    async def main() -> list[tuple[str, int]]:
        log: list[tuple[str, int]] = []
        backend.gate.clear()  # A's first batch waits until B has arrived too
        a = sched.submit("ra", "tenant-a", samples(1, [10] * 200))
        await asyncio.sleep(0.05)
        b = sched.submit("rb", "tenant-b", samples(2, [10] * 10))
        backend.gate.set()
        await asyncio.gather(drain(sched, a, log), drain(sched, b, log))
        return log

    log = asyncio.run(main())
    sched.stop()
    last_b = max(i for i, (tenant, _) in enumerate(log) if tenant == "tenant-b")
    a_before_b_done = sum(1 for tenant, _ in log[:last_b] if tenant == "tenant-a")
    assert a_before_b_done <= 20, f"tenant B waited for {a_before_b_done} of A's samples"
    assert len(log) == 210
    assert sched.inflight_tokens == 0 and not sched.tenant_inflight


def test_batches_never_exceed_the_token_budget() -> None:
    backend = FakeBackend(delay_s=0)
    sched = make(backend, max_batch_tokens=64)
    lengths = [7, 30, 64, 1, 100, 33, 12, 5, 63, 2] * 3  # 100 > budget: must run alone

    async def main() -> None:
        reqs = [sched.submit(f"r{t}", f"t{t % 2}", samples(t, lengths)) for t in range(4)]
        await asyncio.gather(*(drain(sched, r, []) for r in reqs))

    asyncio.run(main())
    sched.stop()
    sizes = [[len(ids) for ids in call] for call in backend.calls]
    assert sum(len(s) for s in sizes) == 4 * len(lengths)
    for call in sizes:
        assert sum(call) <= 64 or call == [100], call
    assert any(len(call) > 1 for call in sizes), "nothing was packed"


def test_cancel_returns_budget_and_drops_remaining_work() -> None:
    backend = FakeBackend(delay_s=0.005)
    sched = make(backend, max_batch_tokens=20)

    async def main() -> None:
        req = sched.submit("r1", "t", samples(3, [10] * 100))
        assert sched.inflight_tokens == 1000 and sched.tenant_inflight == {"t": 1000}
        await drain(sched, req, [], stop_after=6)  # the client goes away after 6 samples
        assert sched.inflight_tokens == 0 and sched.tenant_inflight == {}
        sched.close(req)  # a second close changes nothing
        assert sched.inflight_tokens == 0
        n_calls = len(backend.calls)
        await asyncio.sleep(0.1)
        assert len(backend.calls) <= n_calls + 1  # at most the batch already running
        assert sched.metrics.get("eagle3_cancellations_total") == 1

    asyncio.run(main())
    done = {ids[0] % 1000 for call in backend.calls for ids in call}
    assert len(done) < 20
    sched.stop()


def test_slow_reader_pauses_only_itself() -> None:
    backend = FakeBackend(delay_s=0.001)
    sched = make(backend, max_batch_tokens=40, max_buffered_tokens=40)

    async def main() -> None:
        slow = sched.submit("slow", "t-slow", samples(4, [10] * 100))  # never read
        fast = sched.submit("fast", "t-fast", samples(5, [10] * 50))
        log: list[tuple[str, int]] = []
        await asyncio.wait_for(drain(sched, fast, log), timeout=10)
        assert len(log) == 50
        extracted_slow = sum(1 for call in backend.calls for ids in call if ids[0] // 1000 == 4)
        assert extracted_slow <= 4, "the slow reader's samples kept being computed"
        assert slow.outstanding_tokens <= 40
        sched.close(slow)

    asyncio.run(main())
    assert sched.inflight_tokens == 0
    sched.stop()


def test_admission_quota_and_overload() -> None:
    sched = make(FakeBackend(), max_tenant_inflight_tokens=100, max_inflight_tokens=150)

    async def main() -> None:
        backend_req = sched.submit("r1", "a", samples(1, [60]))
        with pytest.raises(AdmissionError) as quota:
            sched.submit("r2", "a", samples(1, [50]))
        assert quota.value.status == 429 and quota.value.retry_after_s >= 1
        sched.submit("r3", "b", samples(1, [80]))
        with pytest.raises(AdmissionError) as full:
            sched.submit("r4", "c", samples(1, [20]))
        assert (full.value.status, full.value.reason) == (503, "overloaded")
        assert sched.metrics.get("eagle3_rejections_total", reason="tenant_quota") == 1
        sched.close(backend_req)

    asyncio.run(main())
    sched.stop()


def test_a_failing_sample_gets_an_error_and_its_batch_mates_succeed() -> None:
    backend = FakeBackend(fail_id=6002)
    sched = make(backend, max_batch_tokens=100)

    async def main() -> list[Any]:
        backend.gate.clear()
        req = sched.submit("r", "t", samples(6, [5, 5, 5, 5]))
        backend.gate.set()
        results: list[Any] = []
        while len(results) < 4:
            for r in await req.next_results(5.0):
                results.append(r)
                sched.consumed(req, r)
        sched.close(req)
        return results

    results = asyncio.run(main())
    sched.stop()
    errors = {r.sample.index: r.error for r in results if r.error}
    assert list(errors) == [2] and errors[2]["retryable"] is True
    assert sorted(r.sample.index for r in results if r.states is not None) == [0, 1, 3]


def test_a_lone_request_gets_full_passes_while_its_reader_is_one_pass_behind() -> None:
    backend = FakeBackend(delay_s=0)
    sched = make(backend, max_batch_tokens=40)  # default buffer: two passes (80 tokens)

    async def main() -> None:
        req = sched.submit("r", "t", samples(7, [10] * 20))
        deadline = time.monotonic() + 5
        while req.outstanding_tokens < 80 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert [len(call) for call in backend.calls] == [4, 4], "the second pass must not wait for the reader"
        assert req.outstanding_tokens == 80
        await drain(sched, req, [])

    asyncio.run(main())
    sched.stop()
    assert sum(len(call) for call in backend.calls) == 20
    assert sched.inflight_tokens == 0


def test_stop_racing_start_never_joins_an_unstarted_thread() -> None:
    """A server shut down as its model finished loading: ``stop`` (lifespan exit) ran between the load
    thread's creating the worker thread and starting it, and ``Thread.join`` raised "cannot join thread
    before it is started" (seen once in CI: test_error_classes.py::test_unavailable_while_loading_is_retryable).
    Now stop either finds no thread or a started one; a stop before start leaves nothing running."""
    opts = {"max_batch_tokens": 40, "max_inflight_tokens": 100_000, "max_tenant_inflight_tokens": 50_000}
    early = Scheduler(FakeBackend().extract, **opts)  # type: ignore[arg-type]
    assert early.stop(timeout_s=1)
    early.start()
    assert early._thread is None, "a scheduler stopped before it started must not start its worker"
    errors: list[BaseException] = []
    for _ in range(200):
        sched = Scheduler(FakeBackend().extract, **opts)  # type: ignore[arg-type]
        barrier = threading.Barrier(2)

        def run(action: Any, sched: Scheduler = sched, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                action(sched)
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(Scheduler.start,)),
                   threading.Thread(target=run, args=(lambda s: s.stop(timeout_s=5),))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        sched.stop(timeout_s=5)
        assert sched._thread is None or not sched._thread.is_alive()
    assert not errors, errors[:3]
