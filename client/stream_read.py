"""The read loop of one ``/v1/extract`` response: HTTP body bytes -> frames -> samples, timed per stage.

``read_stream`` takes the open ``httpx.Response`` (status 200 already checked), reads the transport's
own chunks with ``iter_raw()`` (re-chunking would copy every byte once more), hands them to a
``FrameDecoder`` (bounds, sequence and checksum of every frame before anything in it is used; large
bodies are copied once into numpy buffers and checksummed piece by piece with zlib-ng's CRC-32,
``core/checksum.py``) and each completed frame to a ``StreamAssembler`` (decode, fill the
sample's arrays, check ids). A frame's samples are yielded before the next frame can raise, so a
stream that breaks late still delivers what it completed.

Stage seconds (``StreamCounters.stage_s``, all calls of a client; ``bench/serving.py`` reads them):
``receive`` waiting on the socket and the HTTP parser (in the async client: on the event loop too),
``verify`` framing and checksums, ``decode`` the codec, safetensors checks and reassembly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from eagle3.client.errors import SampleFailure, StreamError
from eagle3.client.stream import StreamAssembler
from eagle3.core.checksum import crc32
from eagle3.core.protocol.features import DTYPE_BF16
from eagle3.core.protocol.frames import CONTENT_TYPE, Allocate, FrameDecoder
from eagle3.core.protocol.model_identity import ModelIdentity
from eagle3.core.sample import ExtractedSample, NDArray

Outcome = ExtractedSample | SampleFailure


@dataclass
class StreamCounters:
    """A client's totals over all its streams; several request threads add to it (``add``, locked)."""

    wire_bytes: int = 0  # bytes of frame streams received
    stage_s: dict[str, float] = field(default_factory=lambda: {"receive": 0.0, "verify": 0.0, "decode": 0.0})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, wire_bytes: int = 0, receive_s: float = 0.0, verify_s: float = 0.0, decode_s: float = 0.0) -> None:
        with self._lock:
            self.wire_bytes += wire_bytes
            stage = self.stage_s
            stage["receive"] += receive_s
            stage["verify"] += verify_s
            stage["decode"] += decode_s


def _uninitialized(n_bytes: int) -> NDArray:
    """A frame body's buffer: numpy skips the zero fill ``bytearray`` does and asks for huge pages
    (about twice as fast to fill for a 50 MB body here); every byte is overwritten by the frame."""
    return np.empty(n_bytes, np.uint8)


class StreamReader:
    """The sans-IO part of reading one response: ``feed`` each body chunk as it arrives (yielding the
    outcomes of every frame it completes, a frame's before the next can raise), then ``close``. The
    sync and async clients differ only in how they get the chunks (``read_stream``, ``aread_stream``)."""

    def __init__(
        self,
        resp: httpx.Response,
        url: str,
        requests: list[dict[str, Any]],
        expect: ModelIdentity | None,
        counters: StreamCounters,
        allocate: Allocate | None = None,
        dtype: str = DTYPE_BF16,
    ) -> None:
        ctype = resp.headers.get("content-type", "")
        if not ctype.startswith(CONTENT_TYPE.split(";")[0]):
            raise StreamError(f"{url}: unexpected content type {ctype!r}", url=url, retryable=False)
        allocate = allocate or _uninitialized
        self.decoder = FrameDecoder(crc32=crc32, allocate=allocate)
        self.assembler = StreamAssembler(url, requests, self.decoder, expect=expect, allocate=allocate, dtype=dtype)
        self.counters = counters

    def feed(self, chunk: bytes, receive_s: float) -> Iterator[Outcome]:
        """``chunk`` and the seconds spent waiting for it (stage ``receive``)."""
        clock = time.perf_counter
        received = clock()
        frames = self.decoder.feed(chunk)
        self.counters.add(len(chunk), receive_s, verify_s=clock() - received)
        for frame in frames:  # each frame's samples go out before the next frame can raise
            started = clock()
            outcomes = self.assembler.handle(frame)
            self.counters.add(decode_s=clock() - started)
            yield from outcomes

    def close(self, receive_s: float) -> None:
        self.counters.add(receive_s=receive_s)
        self.decoder.close()


def read_stream(
    resp: httpx.Response,
    url: str,
    requests: list[dict[str, Any]],
    expect: ModelIdentity | None,
    counters: StreamCounters,
    allocate: Allocate | None = None,
    dtype: str = DTYPE_BF16,
) -> Iterator[Outcome]:
    """Every outcome of one response's frame stream, in arrival order. Raises ``ProtocolError`` /
    ``TruncatedStreamError`` for a bad or cut stream and ``StreamError`` for an ERROR frame or a body
    that is not a frame stream; the caller maps transport errors. ``allocate``: where big frame bodies and
    multi-frame samples get their memory (default: fresh ``numpy.empty``; ``BufferPool`` recycles)."""
    reader = StreamReader(resp, url, requests, expect, counters, allocate, dtype)
    clock = time.perf_counter
    chunks = resp.iter_raw()
    while True:
        started = clock()
        chunk = next(chunks, None)
        if chunk is None:
            reader.close(clock() - started)
            return
        yield from reader.feed(chunk, clock() - started)


async def aread_stream(
    resp: httpx.Response,
    url: str,
    requests: list[dict[str, Any]],
    expect: ModelIdentity | None,
    counters: StreamCounters,
    allocate: Allocate | None = None,
    dtype: str = DTYPE_BF16,
) -> AsyncIterator[Outcome]:
    """``read_stream`` of an ``httpx.AsyncClient`` response (``aiter_raw``)."""
    reader = StreamReader(resp, url, requests, expect, counters, allocate, dtype)
    clock = time.perf_counter
    chunks = resp.aiter_raw()
    while True:
        started = clock()
        chunk = await anext(chunks, None)
        if chunk is None:
            reader.close(clock() - started)
            return
        for outcome in reader.feed(chunk, clock() - started):
            yield outcome
