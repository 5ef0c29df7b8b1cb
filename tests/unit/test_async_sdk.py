"""AsyncExtractionClient against real frame streams through httpx.MockTransport: the same results, retries,
errors and request cut as the sync client (both use client/base_client.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest

from eagle3 import AsyncExtractionClient as TopLevelAsyncClient
from eagle3.client import AsyncExtractionClient as ClientPackageAsyncClient
from eagle3.client.async_sdk import AsyncExtractionClient
from eagle3.client.errors import BadRequestError, InvalidSampleError, SampleFailedError, ServiceUnavailableError
from eagle3.client.sdk import ExtractionClient
from tests.unit.sdk_fake import AUX, HIDDEN, Call, FakeServer, as_async, expected_hidden

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def make_client(server: FakeServer, sleeps: list[float] | None = None, **kwargs: Any) -> AsyncExtractionClient:
    record = sleeps if sleeps is not None else []

    async def sleep(seconds: float) -> None:
        record.append(seconds)

    return AsyncExtractionClient("http://fake:8000", transport=server.async_transport(), sleep=sleep, **kwargs)


def with_client(server: FakeServer, body: Callable[[AsyncExtractionClient], Awaitable[T]], **kwargs: Any) -> T:
    async def main() -> T:
        async with make_client(server, **kwargs) as client:
            return await body(client)

    return asyncio.run(main())


SAMPLES: list[Any] = [
    [5, 6, 7],
    {"id": "long", "input_ids": [(7 * i) % 250 + 1 for i in range(37)], "loss_mask": [1] * 37},
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
]


def test_the_same_samples_as_the_sync_client_bit_for_bit():
    server = FakeServer(max_payload_bytes=10 * (len(AUX) + 1) * HIDDEN * 2)  # 10 rows per DATA frame: chunked
    got = with_client(server, lambda c: c.extract(SAMPLES))  # awaited: the whole list
    with ExtractionClient("http://fake:8000", transport=server.transport()) as sync:
        want = list(sync.extract(SAMPLES))
    assert [s.sample_id for s in got] == [s.sample_id for s in want] == ["0", "long", "2"]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.hidden_states_bf16, b.hidden_states_bf16)
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    np.testing.assert_array_equal(got[1].hidden_states_bf16, expected_hidden(SAMPLES[1]["input_ids"]))
    assert server.requests[0] == server.requests[1]  # the same request body


def test_async_for_and_info_and_the_exports():
    assert TopLevelAsyncClient is ClientPackageAsyncClient is AsyncExtractionClient
    server = FakeServer()

    async def body(client: AsyncExtractionClient) -> tuple[Any, list[str], int]:
        info = await client.info()
        ids = [s.sample_id async for s in client.extract([[1, 2], [3, 4, 5]], ordered=False)]
        return info, ids, client.wire_bytes

    info, ids, wire_bytes = with_client(server, body)
    assert info.hidden_size == HIDDEN and info.aux_layer_ids == AUX
    assert sorted(ids) == ["0", "1"] and wire_bytes > 0


def test_retry_on_503_with_retry_after():
    server = FakeServer(script=[Call(status=503, headers={"Retry-After": "7"}, error_type="overloaded"), Call()])
    sleeps: list[float] = []
    got = with_client(server, lambda c: c.extract([[1, 2], [3]]), sleeps=sleeps)
    assert [s.sample_id for s in got] == ["0", "1"] and sleeps == [7.0]
    assert len(server.requests) == 2
    server = FakeServer(script=[Call(status=503, headers={"Retry-After": "999"})] * 3)  # out of retries
    sleeps = []
    with pytest.raises(ServiceUnavailableError) as info:
        with_client(server, lambda c: c.extract([[1, 2]]), sleeps=sleeps, max_retries=2)
    assert sleeps == [60.0, 60.0] and info.value.status_code == 503  # capped at max_retry_after_s


def test_a_400_raises_the_typed_error_at_once():
    server = FakeServer(script=[Call(status=400, error_type="invalid_request")])
    sleeps: list[float] = []
    with pytest.raises(BadRequestError, match="HTTP 400 invalid_request"):
        with_client(server, lambda c: c.extract([[1, 2]]), sleeps=sleeps)
    assert len(server.requests) == 1 and sleeps == []
    with pytest.raises(InvalidSampleError):  # checked when the call is made, before any request
        make_client(server).extract([[]])


def test_twice_the_servers_cap_goes_in_requests_under_it():
    server = FakeServer()
    server.info["limits"]["max_request_tokens"] = 40
    samples: list[dict[str, Any]] = [{"id": f"s{i}", "input_ids": [i + 1] * 10} for i in range(8)]  # 80: 2x the cap
    got = with_client(server, lambda c: c.extract(samples))
    assert [s.sample_id for s in got] == [f"s{i}" for i in range(8)]
    sizes = [sum(len(s["input_ids"]) for s in r["samples"]) for r in server.requests]
    assert sizes == [40, 40]
    for s, sent in zip(got, samples, strict=True):
        np.testing.assert_array_equal(s.hidden_states_bf16, expected_hidden(sent["input_ids"]))


def test_a_truncated_stream_resends_only_the_missing_samples():
    server = FakeServer(script=[Call(truncate_after_samples=2)])
    sleeps: list[float] = []
    samples = [{"id": f"s{i}", "input_ids": [i + 1, i + 2]} for i in range(5)]
    got = with_client(server, lambda c: c.extract(samples), sleeps=sleeps)
    assert [s.sample_id for s in got] == [f"s{i}" for i in range(5)]
    assert [r["id"] for r in server.requests[1]["samples"]] == ["s2", "s3", "s4"]
    assert len(sleeps) == 1 and 0 < sleeps[0] <= 0.5


def test_a_failed_sample_comes_last_as_sample_failed_error():
    server = FakeServer(script=[Call(fail_ids=("b",))])

    seen: list[str] = []

    async def body(client: AsyncExtractionClient) -> None:
        async for s in client.extract([{"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": [2]}]):
            seen.append(s.sample_id)

    with pytest.raises(SampleFailedError) as info:
        with_client(server, body)
    assert seen == ["a"]  # every other sample first, then the error naming the failed one
    assert [f.sample_id for f in info.value.failures] == ["b"]


def test_url_from_the_environment_and_an_injected_http_client(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeServer()
    monkeypatch.setenv("EAGLE3_SERVER_URL", "http://from-env:9000/")
    monkeypatch.setenv("EAGLE3_API_KEY", "k-env")
    seen: list[httpx.Request] = []
    handle = as_async(server.handle)

    async def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        response: httpx.Response = await handle(request)
        return response

    async def main() -> bool:
        mine = httpx.AsyncClient(transport=httpx.MockTransport(record))
        async with AsyncExtractionClient(http_client=mine) as client:
            assert client.url == "http://from-env:9000"
            assert [s.sample_id for s in await client.extract([[1, 2]])] == ["0"]
        open_after = not mine.is_closed  # the caller's client is the caller's to close
        await mine.aclose()
        return open_after

    assert run(main())
    assert {str(r.url) for r in seen} == {"http://from-env:9000/v1/info", "http://from-env:9000/v1/extract"}
    assert all(r.headers["authorization"] == "Bearer k-env" for r in seen)


def test_no_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLE3_SERVER_URL", raising=False)
    with pytest.raises(ValueError, match="EAGLE3_SERVER_URL"):
        AsyncExtractionClient()


def test_async_client_recycles_frame_buffers_from_its_pool():
    from eagle3.client.buffer_pool import BufferPool
    from eagle3.core.protocol.frames import Codec

    server = FakeServer(codec=Codec.NONE)
    big: list[dict[str, Any]] = [
        {"id": f"b{i}", "input_ids": [(i + 3 * j) % 250 + 1 for j in range(4000)]} for i in range(3)
    ]  # 384 KB each
    pool = BufferPool(64 << 20)

    async def twice(client: AsyncExtractionClient) -> None:
        for _ in range(2):
            async for item in client.extract(big):
                sent = next(s for s in big if s["id"] == item.sample_id)
                np.testing.assert_array_equal(item.hidden_states_bf16, expected_hidden(sent["input_ids"]))
                del item  # dropped: its buffer is free for the next frame

    with_client(server, twice, buffer_pool=pool)
    assert pool.n_allocated >= 1 and pool.n_reused >= 3, (pool.n_allocated, pool.n_reused)
