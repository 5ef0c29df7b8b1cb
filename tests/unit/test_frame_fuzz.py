"""Fuzz of the response decoding path (frames, codec, assembler, SDK): a damaged or malformed stream
gives only the SDK's typed errors, never a wrong sample and never a bare ValueError/TypeError.

A small real stream (HEADER, a sample split over two DATA frames, a one-frame sample, a SAMPLE_ERROR,
END; zstd+planes payloads, from tests/unit/sdk_fake.py) is (a) cut at every byte offset, (b) given a
single flipped bit at every bit of every fixed header and at 1,500 seeded positions in metas and
payloads, (c) re-encoded with a valid checksum but each meta field replaced by values of wrong types
or ranges, (d) re-encoded with END counts that disagree with what was sent, and (e) served with layer
ids that differ from ``/v1/info``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from eagle3.client.errors import Eagle3Error, IncompatibleError, SampleFailedError, StreamError
from eagle3.client.sdk import ExtractionClient
from eagle3.client.stream import StreamAssembler
from eagle3.core.protocol.frames import (
    CONTENT_TYPE,
    FIXED_HEADER,
    FIXED_HEADER_BYTES,
    Frame,
    FrameDecoder,
    FrameType,
    ProtocolError,
    encode_frame,
)
from tests.unit.sdk_fake import Call, FakeServer, expected_hidden

SAMPLES = [
    {"id": "long", "input_ids": list(range(1, 14))},  # two DATA frames at max_payload_bytes=700
    {"id": "short", "input_ids": [7, 8, 9]},
    {"id": "bad", "input_ids": [5]},  # a SAMPLE_ERROR
]
FUZZ_SEED = 20261204


def clean_stream() -> bytes:
    server = FakeServer(max_payload_bytes=700)
    return server.frames(SAMPLES, Call(fail_ids=("bad",)))


def split_frames(data: bytes) -> list[Frame]:
    decoder = FrameDecoder()
    frames = decoder.feed(data)
    decoder.close()
    return frames


def encode_all(frames: list[Frame]) -> bytes:
    return b"".join(encode_frame(f) for f in frames)


def decode(data: bytes) -> list[Any]:
    """Everything the assembler yields for ``data`` fed in 97-byte chunks, then ``close``."""
    decoder = FrameDecoder()
    assembler = StreamAssembler("http://fuzz", SAMPLES, decoder)
    out: list[Any] = []
    for i in range(0, len(data), 97):
        for frame in decoder.feed(data[i : i + 97]):
            out.extend(assembler.handle(frame))
    decoder.close()
    return out


def assert_correct(items: list[Any]) -> None:
    """Every sample delivered is exactly what was sent for it (ids, mask, states bit for bit)."""
    want = {s["id"]: s["input_ids"] for s in SAMPLES}
    for item in items:
        if hasattr(item, "hidden_states_bf16"):
            ids: list[int] = want[item.sample_id]  # type: ignore[assignment]
            np.testing.assert_array_equal(item.input_ids, ids)
            np.testing.assert_array_equal(item.hidden_states_bf16, expected_hidden(ids))
        else:
            assert item.sample_id == "bad", item


def test_the_clean_stream_decodes() -> None:
    items = decode(clean_stream())
    assert [i.sample_id for i in items] == ["long", "short", "bad"]
    assert_correct(items)
    assert [f.type for f in split_frames(clean_stream())].count(FrameType.DATA) == 3


def test_truncation_at_every_offset_is_a_typed_error_and_what_came_before_is_right() -> None:
    data = clean_stream()
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):  # TruncatedStreamError is one
            decode(data[:cut])
        decoder, assembler, got = FrameDecoder(), StreamAssembler("http://fuzz", SAMPLES), []
        for frame in decoder.feed(data[:cut]):
            got.extend(assembler.handle(frame))
        assert_correct(got)


def flips() -> list[int]:
    """Bit positions: every bit of every fixed header, plus seeded ones in metas and payloads."""
    data = clean_stream()
    headers: list[int] = []
    offset = 0
    while offset < len(data):
        _, _, _, _, _, meta_len, payload_len, _, _ = FIXED_HEADER.unpack_from(data, offset)
        headers += range(offset * 8, (offset + FIXED_HEADER_BYTES) * 8)
        offset += FIXED_HEADER_BYTES + meta_len + payload_len
    body = sorted(set(range(len(data) * 8)) - set(headers))
    return headers + random.Random(FUZZ_SEED).sample(body, 1500)


def test_every_single_bit_flip_is_detected() -> None:
    """CRC-32 over the whole frame catches every single-bit error: in a length (the stream then ends
    inside a frame or the checksum fails), a type, a seq, a codec, the meta or the payload."""
    data = clean_stream()
    positions = flips()
    assert len(positions) > 1500 + 5 * FIXED_HEADER_BYTES * 8
    for bit in positions:
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ProtocolError):
            decode(bytes(damaged))


BAD_VALUES: list[Any] = [None, "x", -1, 1e300, 10**30, [], {}, True, {"type": 5}]


def meta_mutations() -> list[tuple[int, str, Any]]:
    frames = split_frames(clean_stream())
    return [(i, key, value) for i, f in enumerate(frames) for key in f.meta for value in BAD_VALUES]


def sdk_run(data: bytes, info: dict[str, Any] | None = None) -> list[Any]:
    """The bytes as the body of a 200 /v1/extract answer, decoded by ExtractionClient (no retries)."""
    fake = FakeServer(max_payload_bytes=700)
    served_info = info or fake.info

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info":
            return httpx.Response(200, json=served_info)
        chunks = (data[i : i + 777] for i in range(0, len(data), 777))
        return httpx.Response(200, content=chunks, headers={"content-type": CONTENT_TYPE})

    with ExtractionClient("http://fuzz", transport=httpx.MockTransport(handle), max_retries=0) as client:
        client.info()
        return list(client.extract_stream(SAMPLES))


def test_malformed_meta_with_a_valid_checksum_raises_only_typed_errors() -> None:
    frames = split_frames(clean_stream())
    cases = meta_mutations()
    assert len(cases) > 300
    outcomes = {"typed error": 0, "delivered": 0}
    for index, key, value in cases:
        mutated = list(frames)
        f = mutated[index]
        mutated[index] = Frame(f.type, f.seq, {**f.meta, key: value}, f.payload, f.codec)
        try:
            items = sdk_run(encode_all(mutated))
        except Eagle3Error:
            outcomes["typed error"] += 1
            continue
        except Exception as exc:  # noqa: BLE001 (the point: anything else is a bug)
            pytest.fail(f"frame {index} {key}={value!r}: {type(exc).__name__}: {exc}")
        assert_correct(items)  # a field the client does not need may be anything
        outcomes["delivered"] += 1
    assert outcomes["typed error"] > outcomes["delivered"] > 0, outcomes


@pytest.mark.parametrize(
    ("key", "delta"), [("n_frames", 1), ("n_samples", -1), ("n_failed", 1), ("n_tokens", 3), ("n_samples", 1)]
)
def test_end_counts_must_match_what_was_received(key: str, delta: int) -> None:
    frames = split_frames(clean_stream())
    end = frames[-1]
    frames[-1] = Frame(end.type, end.seq, {**end.meta, key: end.meta[key] + delta})
    with pytest.raises(StreamError, match="END counts"):
        sdk_run(encode_all(frames))


def test_end_before_every_sample_was_answered_is_an_error() -> None:
    frames = split_frames(clean_stream())
    without_error = [f for f in frames if f.type != FrameType.SAMPLE_ERROR]
    renumbered = [Frame(f.type, seq, f.meta, f.payload, f.codec) for seq, f in enumerate(without_error)]
    end = renumbered[-1]
    renumbered[-1] = Frame(end.type, end.seq, {**end.meta, "n_frames": end.seq + 1, "n_failed": 0})
    with pytest.raises(StreamError, match="END before 1 requested sample"):
        sdk_run(encode_all(renumbered))


@pytest.mark.parametrize(
    "change",
    [
        lambda info: info.update(aux_layer_ids=[0, 2]),
        lambda info: info.update(final_layer_id=5),
        lambda info: info.update(hidden_size=32),
    ],
)
def test_header_layer_ids_must_equal_v1_info(change: Callable[[dict[str, Any]], None]) -> None:
    info = json.loads(json.dumps(FakeServer().info))
    change(info)
    with pytest.raises(IncompatibleError, match="/v1/info said"):
        sdk_run(clean_stream(), info)


def test_a_sample_error_still_raises_sample_failed_after_a_clean_stream() -> None:
    fake = FakeServer(max_payload_bytes=700, script=[Call(fail_ids=("bad",))])
    client = ExtractionClient("http://fuzz", transport=fake.transport(), max_retries=0)
    with client, pytest.raises(SampleFailedError):
        list(client.extract(SAMPLES))


def test_a_server_of_another_protocol_version_is_incompatible() -> None:
    info = {**FakeServer().info, "protocol_version": 1}
    with pytest.raises(IncompatibleError, match="protocol 1"):
        sdk_run(clean_stream(), info)
