"""``draft_trainer/prefetch.py``: the bounded prefetch behind ``eagle3 train --server`` (no server needed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.errors import DataError
from eagle3.draft_trainer.prefetch import Prefetcher

SLOT_BYTES = 100


def _sample(pos: int) -> ExtractedSample:
    states = np.full((2, 4, 3), pos, dtype=np.uint16)  # [n, L, H]
    return ExtractedSample(f"s{pos}", np.zeros(2, np.int32), np.ones(2, np.uint8), states, (1, 2, 3), 4)


class FakeSource:
    """Fetches take ``delay_s``; records the admitted bytes seen while fetching, workers, and concurrency."""

    def __init__(self, delay_s: float = 0.01, fail_on: int | None = None) -> None:
        self.delay_s, self.fail_on = delay_s, fail_on
        self.workers: set[int] = set()
        self.active = self.max_active = 0
        self.lock = threading.Lock()
        self.requests: list[list[int]] = []

    def fetch(self, positions: list[int], worker: int) -> Iterator[tuple[int, ExtractedSample]]:
        with self.lock:
            self.workers.add(worker)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.requests.append(list(positions))
        try:
            time.sleep(self.delay_s)
            for pos in positions:
                if pos == self.fail_on:
                    raise DataError(f"sample 's{pos}' failed: invalid_request: too long")
                yield pos, _sample(pos)
        finally:
            with self.lock:
                self.active -= 1


def _plan(n: int) -> list[list[int]]:
    return [[2 * i, 2 * i + 1] for i in range(n)]


def _work(plan: list[list[int]]) -> Iterator[tuple[list[int], list[int], int]]:
    return ((b, b, SLOT_BYTES) for b in plan)


def _alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("eagle3-prefetch") and t.is_alive()]


def test_in_order_whole_bounded_and_shared_by_the_workers() -> None:
    source = FakeSource()
    plan = _plan(30)
    prefetch = Prefetcher(source.fetch, n_workers=3, max_bytes=3 * SLOT_BYTES)
    with prefetch:
        prefetch.start(_work(plan))
        for batch in plan:
            assert prefetch.window_bytes <= 3 * SLOT_BYTES  # never more than the bound (whole slots)
            got = prefetch.take(batch)
            assert sorted(got) == batch and all(int(got[p].hidden_states_bf16[0, 0, 0]) == p for p in batch)
        assert prefetch.next_positions() is None
    assert source.max_active <= 3 and len(source.workers) > 1  # several requests in flight, several workers
    assert sorted(p for r in source.requests for p in r) == list(range(60))  # each sample fetched once
    assert prefetch.stats.fetched_samples == 60 and prefetch.stats.fetched_bytes == 60 * 2 * 4 * 3 * 2
    assert not _alive()


def test_one_slot_is_admitted_even_over_the_bound_and_cached_slots_fetch_nothing() -> None:
    source = FakeSource()
    prefetch = Prefetcher(source.fetch, n_workers=2, max_bytes=1)
    upcoming = iter([([0, 1], [0, 1], 10_000), ([2], [], 0), ([3], [3], 10)])
    with prefetch:
        prefetch.start(upcoming)
        assert prefetch.take([0, 1]).keys() == {0, 1}
        assert prefetch.take([2]) == {}  # nothing to fetch: read from the cache by the caller
        assert prefetch.take([3]).keys() == {3}
    assert source.requests == [[0, 1], [3]]


def test_out_of_order_take_is_refused() -> None:
    prefetch = Prefetcher(FakeSource().fetch, n_workers=1, max_bytes=SLOT_BYTES)
    with prefetch:
        prefetch.start(_work(_plan(3)))
        with pytest.raises(DataError, match="out of plan order"):
            prefetch.take([2, 3])


def test_a_fetch_error_comes_at_its_slot_after_the_slots_before_it() -> None:
    plan = _plan(6)
    prefetch = Prefetcher(FakeSource(fail_on=7).fetch, n_workers=2, max_bytes=4 * SLOT_BYTES)
    with prefetch:
        prefetch.start(_work(plan))
        for batch in plan[:3]:
            prefetch.take(batch)
        with pytest.raises(DataError, match="'s7' failed"):
            prefetch.take(plan[3])
    assert not _alive()


def test_a_source_that_ends_short_is_an_error() -> None:
    def short(positions: list[int], worker: int) -> Iterator[tuple[int, ExtractedSample]]:
        yield positions[0], _sample(positions[0])

    prefetch = Prefetcher(short, n_workers=1, max_bytes=SLOT_BYTES)
    with prefetch:
        prefetch.start(_work(_plan(1)))
        with pytest.raises(DataError, match="without 1 samples"):
            prefetch.take([0, 1])
