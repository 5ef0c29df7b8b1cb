"""The read loop of one ``/v1/extract`` response: HTTP body bytes -> frames -> samples, timed per stage.

``read_stream`` takes the open ``httpx.Response`` (status 200 already checked), reads the transport's
own chunks with ``iter_raw()`` (re-chunking would copy every byte once more), hands them to a
``FrameDecoder`` (bounds, sequence and checksum of every frame before anything in it is used; large
bodies are copied once into numpy buffers and checksummed piece by piece with zlib-ng's CRC-32,
``core/checksum.py``) and each completed frame to a ``StreamAssembler`` (decode, fill the
sample's arrays, check ids). A frame's samples are yielded before the next frame can raise, so a
stream that breaks late still delivers what it completed.

Stage seconds (``StreamCounters.stage_s``, all calls of a client; ``bench/serving.py`` reads them):
``receive`` waiting on the socket and the HTTP parser, ``verify`` framing and checksums, ``decode`` the
codec, safetensors checks and reassembly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from eagle3.client.errors import SampleFailure, StreamError
from eagle3.client.stream import StreamAssembler
from eagle3.core.checksum import crc32
from eagle3.core.protocol.frames import CONTENT_TYPE, FrameDecoder
from eagle3.core.sample import ExtractedSample, NDArray

Outcome = ExtractedSample | SampleFailure


@dataclass
class StreamCounters:
    wire_bytes: int = 0  # bytes of frame streams received
    stage_s: dict[str, float] = field(default_factory=lambda: {"receive": 0.0, "verify": 0.0, "decode": 0.0})


def _uninitialized(n_bytes: int) -> NDArray:
    """A frame body's buffer: numpy skips the zero fill ``bytearray`` does and asks for huge pages
    (about twice as fast to fill for a 50 MB body here); every byte is overwritten by the frame."""
    return np.empty(n_bytes, np.uint8)


def read_stream(
    resp: httpx.Response,
    url: str,
    requests: list[dict[str, Any]],
    expect: dict[str, Any] | None,
    counters: StreamCounters,
) -> Iterator[Outcome]:
    """Every outcome of one response's frame stream, in arrival order. Raises ``ProtocolError`` /
    ``TruncatedStreamError`` for a bad or cut stream and ``StreamError`` for an ERROR frame or a body
    that is not a frame stream; the caller maps transport errors."""
    ctype = resp.headers.get("content-type", "")
    if not ctype.startswith(CONTENT_TYPE.split(";")[0]):
        raise StreamError(f"{url}: unexpected content type {ctype!r}", url=url, retryable=False)
    decoder = FrameDecoder(crc32=crc32, allocate=_uninitialized)
    assembler = StreamAssembler(url, requests, decoder, expect=expect)
    stage = counters.stage_s
    clock = time.perf_counter
    chunks = resp.iter_raw()
    while True:
        started = clock()
        chunk = next(chunks, None)
        received = clock()
        stage["receive"] += received - started
        if chunk is None:
            break
        counters.wire_bytes += len(chunk)
        frames = decoder.feed(chunk)
        stage["verify"] += clock() - received
        for frame in frames:  # each frame's samples go out before the next frame can raise
            started = clock()
            outcomes = assembler.handle(frame)
            stage["decode"] += clock() - started
            yield from outcomes
    decoder.close()
