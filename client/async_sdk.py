"""``AsyncExtractionClient``: ``ExtractionClient`` for asyncio code (notebooks, async services).

    from eagle3 import AsyncExtractionClient
    async with AsyncExtractionClient("http://gpu-node:8000") as c:
        info = await c.info()
        samples = await c.extract([[1, 2, 3], [{"role": "user", "content": "hi"}, ...]])  # a list
        async for s in c.extract(many):  # or one sample at a time, as they arrive
            s.hidden_states

The same public surface and behaviour as the sync client (``client/sdk.py``), on ``httpx.AsyncClient``:
settings, request cut by the server's ``/v1/info`` limits, retry decisions (``client/retry.py``),
ordering and error mapping are the shared, transport-independent pieces of ``client/base_client.py``;
frames are decoded by the same sans-IO ``StreamReader`` (``client/stream_read.py``). Only sending,
reading and sleeping are async here. ``extract`` and ``extract_stream`` return an ``AsyncResults``:
``async for`` it, or ``await`` it for the whole list. Samples are validated when the call is made.
Decoding a frame runs on the event loop (it is CPU work of about a millisecond per MB); one client
may serve several concurrent calls (``asyncio.gather``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterable
from functools import partial
from typing import Any, Generic, Literal, TypeVar

import httpx

from eagle3.client.base_client import (
    DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_S,
    TRANSPORT_ERRORS,
    BaseClient,
    BatchAttempts,
    InputOrder,
    ReadyPoll,
    new_request_id,
    split_requests,
    transport_error,
)
from eagle3.client.buffer_pool import BufferPool
from eagle3.client.errors import APIError
from eagle3.client.http_client import describe_readyz, new_async_http_client, per_call_timeout, response_status_error
from eagle3.client.request_pipeline import apipelined
from eagle3.client.request_samples import Sample, to_request_samples
from eagle3.client.retry import MAX_RETRY_AFTER_S
from eagle3.client.stream_read import Outcome, aread_stream
from eagle3.core.protocol.features import DTYPE_BF16
from eagle3.core.protocol.generate import GenerateResponse
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample

T = TypeVar("T")
R = TypeVar("R")


class AsyncResults(Generic[T]):
    """The results of one call: ``async for`` yields them as they come, ``await`` collects them in a
    list (openai-python's ``AsyncPaginator`` shape). Either once: the call streams, it does not replay.
    Leaving an ``async for`` early: ``await results.aclose()`` ends the request at once (else when the
    results are garbage-collected)."""

    def __init__(self, iterator: AsyncGenerator[T, None]) -> None:
        self._iterator = iterator

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterator

    def __await__(self) -> Generator[Any, None, list[T]]:
        return self._collect().__await__()

    async def _collect(self) -> list[T]:
        return [item async for item in self._iterator]

    async def aclose(self) -> None:
        await self._iterator.aclose()


class AsyncExtractionClient(BaseClient):
    """An async client of one or more extraction servers: info, readiness, generation and extraction."""

    def __init__(
        self,
        urls: str | list[str] | None = None,
        api_key: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_retry_after_s: float = MAX_RETRY_AFTER_S,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        cache: str | None = None,
        dtype: str = DTYPE_BF16,
        buffer_pool: BufferPool | None = None,
        max_in_flight_requests: int = DEFAULT_MAX_IN_FLIGHT_REQUESTS,
    ) -> None:
        """As ``ExtractionClient``; ``http_client`` is an ``httpx.AsyncClient`` of yours (used as is, not
        closed by ``close()``), ``transport`` an ``httpx.AsyncBaseTransport`` (tests:
        ``httpx.MockTransport``), ``sleep`` a coroutine function (``asyncio.sleep``). A call's requests
        beyond the first stream as tasks, ``max_in_flight_requests`` at once (``client/request_pipeline.py``)."""
        super().__init__(
            urls,
            api_key,
            max_retries=max_retries,
            max_retry_after_s=max_retry_after_s,
            cache=cache,
            dtype=dtype,
            max_in_flight_requests=max_in_flight_requests,
        )
        self._sleep = sleep
        self._allocate = buffer_pool
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else new_async_http_client(timeout_s, transport)

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncExtractionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- small routes ---------------------------------------------------------------------------

    async def info(self) -> ServerInfo:
        """``GET /v1/info`` of the current server (retried like any request)."""
        data = await self._with_retries(lambda url: self._call_json("GET", url, "/v1/info", new_request_id()))
        return self._server_info(data)

    async def ready(self) -> bool:
        """``GET /readyz`` of the current server: True when it is loaded and not draining."""
        try:
            return (await self._http.get(self.url + "/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def loading_state(self) -> str | None:
        """None when the current server is ready (or does not answer); else one line on why not."""
        try:
            resp = await self._http.get(self.url + "/readyz")
        except httpx.HTTPError:
            return None
        return None if resp.status_code == 200 else describe_readyz(resp)

    async def wait_until_ready(
        self,
        timeout_s: float | None = 1800.0,
        poll_s: float = 2.0,
        *,
        report: Callable[[str], None] | None = None,
        report_every_s: float = 30.0,
    ) -> None:
        """Until some server of the list answers ``/readyz`` 200 (``ExtractionClient.wait_until_ready``)."""
        poll = ReadyPoll(timeout_s, report, report_every_s)
        while True:
            for index, url in enumerate(self.urls):
                try:
                    answer: httpx.Response | httpx.HTTPError = await self._http.get(url + "/readyz")
                except httpx.HTTPError as exc:
                    answer = exc
                if poll.answer(url, answer):
                    self._url_index = index
                    return
            poll.end_round(self.url)
            await self._sleep(poll_s)

    async def generate(self, prompts: Iterable[Any], **settings: Any) -> GenerateResponse:
        """``POST /v1/generate`` (``ExtractionClient.generate``; settings of ``eagle3.client.generate``)."""
        from eagle3.client.generate import agenerate

        return await agenerate(self, prompts, **settings)

    # -- extraction -----------------------------------------------------------------------------

    def extract(
        self,
        samples: Iterable[Sample],
        codec: str | None = None,
        *,
        ordered: bool = True,
        on_sample_error: Literal["raise", "skip"] = "raise",
        timeout_s: float | None = None,
    ) -> AsyncResults[ExtractedSample]:
        """One ``ExtractedSample`` per input sample, as ``ExtractionClient.extract`` (``timeout_s``: this
        call's read timeout): ``await`` it for the list, or ``async for`` over it."""
        requests = to_request_samples(samples)  # validate now, not at the first sample
        per_call_timeout(timeout_s)
        order = InputOrder(requests, ordered, on_sample_error)
        return AsyncResults(self._extract_ordered(requests, codec, order, timeout_s))

    async def _extract_ordered(
        self, requests: list[dict[str, Any]], codec: str | None, order: InputOrder, timeout_s: float | None = None
    ) -> AsyncGenerator[ExtractedSample, None]:
        async for item in self._extract_all(requests, codec, timeout_s):
            for ready in order.push(item):
                yield ready
        order.finish()

    def extract_stream(
        self, samples: Iterable[Sample], codec: str | None = None, *, timeout_s: float | None = None
    ) -> AsyncResults[Outcome]:
        """Every sample exactly once, in arrival order: an ``ExtractedSample`` or a ``SampleFailure``."""
        per_call_timeout(timeout_s)
        return AsyncResults(self._extract_all(to_request_samples(samples), codec, timeout_s))

    async def _extract_all(
        self, requests: list[dict[str, Any]], codec: str | None, timeout_s: float | None = None
    ) -> AsyncGenerator[Outcome, None]:
        limits = self._limits or self._remember_limits(await self.info())
        streams = [partial(self._extract_batch, batch, codec, timeout_s) for batch in split_requests(requests, limits)]
        async for item in apipelined(streams, self.max_in_flight_requests):
            yield item

    async def _extract_batch(
        self, requests: list[dict[str, Any]], codec: str | None, timeout_s: float | None = None
    ) -> AsyncGenerator[Outcome, None]:
        batch = BatchAttempts(requests, self.max_retries)
        while not batch.done:
            try:
                async for item in self._stream_once(self.url, batch.start(), codec, timeout_s):
                    if batch.take(item):
                        yield item
                batch.check_complete(self.url)
            except APIError as exc:
                final = batch.after_error(exc)
                if final is not None:
                    for failure in final:
                        yield failure
                    return
                await self._sleep(self._prepare_retry(exc, batch.attempt, len(batch.pending)))
                batch.attempt += 1

    async def _stream_once(
        self, url: str, requests: list[dict[str, Any]], codec: str | None, timeout_s: float | None = None
    ) -> AsyncGenerator[Outcome, None]:
        body = self._extract_body(requests, codec)
        request_id = new_request_id()
        headers, timeout = self._headers(request_id), per_call_timeout(timeout_s)
        try:
            async with self._http.stream("POST", url + "/v1/extract", json=body, headers=headers, **timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise response_status_error(resp, url)
                async for item in aread_stream(
                    resp, url, requests, self._identity.get(url), self.counters, self._allocate, self.dtype
                ):
                    yield item
        except TRANSPORT_ERRORS as exc:
            raise transport_error(exc, url, request_id) from None

    # -- plumbing -------------------------------------------------------------------------------

    async def _call_json(
        self,
        method: str,
        url: str,
        path: str,
        request_id: str,
        body: Any = None,
        timeout_s: float | None = None,
        parse: bool = True,
    ) -> Any:
        """``ExtractionClient._call_json``, awaited."""
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=10.0)}
        try:
            resp = await self._http.request(method, url + path, json=body, headers=self._headers(request_id), **extra)
        except httpx.TransportError as exc:
            raise transport_error(exc, url, None, path) from None
        if resp.status_code != 200:
            raise response_status_error(resp, url)
        return resp.json() if parse else resp

    async def _with_retries(self, call: Callable[[str], Awaitable[R]]) -> R:
        attempt = 0
        while True:
            try:
                return await call(self.url)
            except APIError as exc:
                await self._sleep(self._retry_or_raise(exc, attempt))
                attempt += 1
