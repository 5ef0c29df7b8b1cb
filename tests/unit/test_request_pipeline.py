"""Several requests of one call in flight (client/request_pipeline.py): order, the in-flight bound, errors in
order, leaving early stops every request; and through the SDKs against the scripted server, requests that
really overlap (a request held at the server until the next one arrives completes only when they do)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import httpx
import numpy as np
import pytest

from eagle3.client.async_sdk import AsyncExtractionClient
from eagle3.client.errors import BadRequestError
from eagle3.client.request_pipeline import apipelined, pipelined
from eagle3.client.sdk import ExtractionClient
from eagle3.core.protocol.frames import CONTENT_TYPE
from tests.unit.sdk_fake import Call, FakeServer, expected_hidden


class Requests:
    """Fake requests: request ``r`` yields ``(r, 0..n-1)`` after random small delays; records how many run
    at once and which were started, closed and stopped."""

    def __init__(self, n_requests: int, n_items: int = 5, fail_at: int | None = None) -> None:
        self.n_items = n_items
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.started: list[int] = []
        self.closed: set[int] = set()
        self.saw_stop: set[int] = set()
        self.streams = [self._stream(r) for r in range(n_requests)]

    def _stream(self, r: int) -> Callable[[threading.Event], Generator[tuple[int, int], None, None]]:
        def run(stop: threading.Event) -> Generator[tuple[int, int], None, None]:
            with self.lock:
                self.started.append(r)
                self.running += 1
                self.max_running = max(self.max_running, self.running)
            rng = random.Random(r)
            try:
                for i in range(self.n_items):
                    time.sleep(rng.uniform(0, 0.003))
                    if stop.is_set():
                        self.saw_stop.add(r)
                    if r == self.fail_at and i == 2:
                        raise BadRequestError(f"request {r} is bad", status_code=400)
                    yield r, i
            finally:
                with self.lock:
                    self.running -= 1
                    self.closed.add(r)

        return run


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_outcomes_come_request_by_request_in_order_with_at_most_n_running(in_flight: int) -> None:
    fake = Requests(9)
    got = list(pipelined(fake.streams, in_flight))
    assert got == [(r, i) for r in range(9) for i in range(5)]
    assert fake.max_running <= in_flight
    assert fake.closed == set(range(9))
    if in_flight > 1:
        assert fake.max_running > 1, "requests must overlap"


def test_a_request_starts_only_once_the_one_n_before_it_was_consumed() -> None:
    fake = Requests(6)
    outcomes = pipelined(fake.streams, 2)
    assert next(outcomes) == (0, 0)
    time.sleep(0.1)  # plenty of time for every request to start if nothing held them back
    assert sorted(fake.started) == [0, 1]  # request 2 waits until request 0 is fully taken
    rest = list(outcomes)
    assert len(rest) == 6 * 5 - 1


def test_an_error_comes_after_the_outcomes_before_it_and_stops_the_rest() -> None:
    fake = Requests(6, fail_at=2)
    got: list[tuple[int, int]] = []
    with pytest.raises(BadRequestError, match="request 2 is bad"):
        got.extend(pipelined(fake.streams, 3))
    assert got == [(r, i) for r in range(2) for i in range(5)] + [(2, 0), (2, 1)]
    assert 5 not in fake.started  # never started: the call ended at request 2
    deadline = time.monotonic() + 5
    while fake.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.running == 0, "requests in flight after the error must stop"


def test_leaving_early_stops_and_closes_every_request_in_flight() -> None:
    fake = Requests(8, n_items=200)
    outcomes = pipelined(fake.streams, 4)
    assert next(outcomes) == (0, 0)
    outcomes.close()
    deadline = time.monotonic() + 5
    while fake.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.running == 0 and set(fake.started) <= fake.closed
    assert set(fake.started) == {0, 1, 2, 3} and len(fake.started) == 4


def test_in_flight_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        list(pipelined(Requests(2).streams, 0))
    with pytest.raises(ValueError, match="max_in_flight_requests must be at least 1"):
        ExtractionClient("http://fake:8000", max_in_flight_requests=0)


def _async_streams(n_requests: int, n_items: int, log: dict[str, Any]) -> list[Callable[[], AsyncIterator[int]]]:
    def make(r: int) -> Callable[[], AsyncIterator[int]]:
        async def run() -> AsyncIterator[int]:
            log["running"] += 1
            log["max_running"] = max(log["max_running"], log["running"])
            log["started"].append(r)
            try:
                for i in range(n_items):
                    await asyncio.sleep(random.Random(r * 100 + i).uniform(0, 0.003))
                    yield r * 1000 + i
            finally:
                log["running"] -= 1

        return run

    return [make(r) for r in range(n_requests)]


def test_async_order_bound_and_cancel_on_aclose() -> None:
    async def main() -> None:
        log: dict[str, Any] = {"running": 0, "max_running": 0, "started": []}
        got = [x async for x in apipelined(_async_streams(7, 4, log), 3)]
        assert got == [r * 1000 + i for r in range(7) for i in range(4)]
        assert 1 < log["max_running"] <= 3 and log["running"] == 0

        log = {"running": 0, "max_running": 0, "started": []}
        outcomes = apipelined(_async_streams(7, 1000, log), 3)
        assert await anext(outcomes) == 0
        await outcomes.aclose()
        assert log["running"] == 0 and sorted(log["started"]) == [0, 1, 2]  # cancelled at once

    asyncio.run(main())


# -- through the SDKs ---------------------------------------------------------------------------------------


def _held_server(n_requests_to_meet: int) -> tuple[FakeServer, list[bool]]:
    """A server that holds each of the first requests until ``n_requests_to_meet`` have arrived (True in the
    list: they met; False: a request waited 3 s for a partner that never came)."""
    arrived = threading.Semaphore(0)
    met: list[bool] = []
    count = {"n": 0}
    lock = threading.Lock()

    def on_call(body: dict[str, Any]) -> None:
        with lock:
            count["n"] += 1
            first = count["n"] <= n_requests_to_meet
        if first:
            arrived.release()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if count["n"] >= n_requests_to_meet:
                    met.append(True)
                    return
                time.sleep(0.005)
            met.append(False)

    server = FakeServer(on_call=on_call)
    server.info["limits"]["max_request_tokens"] = 40
    return server, met


SAMPLES: list[dict[str, Any]] = [
    {"id": f"s{i}", "input_ids": [i + 1] * 10} for i in range(16)
]  # 160 tokens: 4 requests of 40


def test_sdk_keeps_requests_in_flight_and_returns_the_same_samples() -> None:
    server, met = _held_server(2)
    with ExtractionClient("http://fake:8000", transport=server.transport(), max_in_flight_requests=2) as client:
        got = list(client.extract(SAMPLES))
    assert met[:2] == [True, True], "the second request must be sent while the first is being answered"
    assert [s.sample_id for s in got] == [s["id"] for s in SAMPLES]
    for item, sent in zip(got, SAMPLES, strict=True):
        np.testing.assert_array_equal(item.hidden_states_bf16, expected_hidden(sent["input_ids"]))
    assert len(server.requests) == 4
    assert client.wire_bytes > 0

    server, met = _held_server(2)  # the control: one at a time, the first request waits in vain
    with ExtractionClient("http://fake:8000", transport=server.transport(), max_in_flight_requests=1) as client:
        again = list(client.extract(SAMPLES))
    assert met[0] is False
    for a, b in zip(got, again, strict=True):
        np.testing.assert_array_equal(a.hidden_states_bf16, b.hidden_states_bf16)


def test_sdk_retries_each_request_on_its_own_under_pipelining() -> None:
    # whichever request comes second is cut after one sample: it alone is resent, for its missing samples
    server = FakeServer(script=[Call(), Call(truncate_after_samples=1)])
    server.info["limits"]["max_request_tokens"] = 40
    sleeps: list[float] = []
    with ExtractionClient("http://fake:8000", transport=server.transport(), sleep=sleeps.append,
                          max_in_flight_requests=4) as client:  # fmt: skip
        got = list(client.extract(SAMPLES))
    assert [s.sample_id for s in got] == [s["id"] for s in SAMPLES]
    assert len(server.requests) == 5 and len(sleeps) == 1
    assert sorted(len(r["samples"]) for r in server.requests) == [3, 4, 4, 4, 4]


def test_async_sdk_keeps_requests_in_flight() -> None:
    server, met = _held_server(2)
    handle = server.handle  # its hold is a thread-blocking wait: each request's handler runs on a thread

    async def handle_async(request: httpx.Request) -> httpx.Response:
        await request.aread()
        resp = await asyncio.to_thread(handle, request)

        async def body() -> Any:
            for chunk in resp.stream:  # type: ignore[union-attr]
                yield chunk

        return httpx.Response(resp.status_code, headers=resp.headers, content=body())

    async def main() -> list[Any]:
        transport = httpx.MockTransport(handle_async)
        async with AsyncExtractionClient("http://fake:8000", transport=transport, max_in_flight_requests=3) as c:
            return await c.extract(SAMPLES)

    got = asyncio.run(main())
    assert met[:2] == [True, True]
    assert [s.sample_id for s in got] == [s["id"] for s in SAMPLES]
    for item, sent in zip(got, SAMPLES, strict=True):
        np.testing.assert_array_equal(item.hidden_states_bf16, expected_hidden(sent["input_ids"]))


def test_leaving_early_stops_retrying_requests_and_their_threads() -> None:
    # the first request answers; every other one is cut before its first sample (retryable) and resent for as
    # long as the retry budget lasts: only the check before each attempt can stop those threads
    server = FakeServer()
    server.info["limits"]["max_request_tokens"] = 40
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/extract":
            return server.handle(request)
        samples = json.loads(request.content)["samples"]
        sent.append(samples[0]["id"])
        call = Call() if samples[0]["id"] == "s0" else Call(truncate_after_samples=0)
        data = server.frames(samples, call)
        return httpx.Response(200, content=iter([data]), headers={"content-type": CONTENT_TYPE})

    with ExtractionClient("http://fake:8000", transport=httpx.MockTransport(handle), max_retries=10**9,
                          sleep=lambda _s: time.sleep(0.001), max_in_flight_requests=3) as client:  # fmt: skip
        outcomes = client.extract_stream(SAMPLES)
        assert next(outcomes).sample_id == "s0"
        time.sleep(0.05)
        assert len(sent) > 3, "the other requests should be retrying"
        outcomes.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while any(t.name == "eagle3-request" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(t.name == "eagle3-request" for t in threading.enumerate()), "request threads outlived the call"
        n_sent = len(sent)
        time.sleep(0.2)
        assert len(sent) == n_sent, "a request was sent after the caller left"
