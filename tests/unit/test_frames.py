"""The frame stream parser: round trips at any chunking, and every malformed input is named."""

from __future__ import annotations

import struct

import pytest

from eagle3.core.protocol.frames import (
    FIXED_HEADER_BYTES,
    Codec,
    Frame,
    FrameDecoder,
    FrameType,
    ProtocolError,
    TruncatedStreamError,
    encode_frame,
)


def stream() -> list[Frame]:
    return [
        Frame(FrameType.HEADER, 0, {"protocol": 1, "hidden_size": 576}),
        Frame(FrameType.DATA, 1, {"sample_id": "a", "raw_bytes": 5}, b"\x00\x01\x02\x03\x04", Codec.ZSTD),
        Frame(FrameType.HEARTBEAT, 2),
        Frame(FrameType.SAMPLE_ERROR, 3, {"sample_id": "b", "error": {"type": "x", "message": "y"}}),
        Frame(FrameType.END, 4, {"n_samples": 1}),
    ]


@pytest.mark.parametrize("chunk", [1, 7, 32, 33, 1000])
def test_round_trip_at_any_chunking(chunk):
    wire = b"".join(encode_frame(f) for f in stream())
    decoder = FrameDecoder()
    got: list[Frame] = []
    for i in range(0, len(wire), chunk):
        got += decoder.feed(wire[i : i + chunk])
    decoder.close()
    assert got == stream()


def test_truncated_stream_is_detected_inside_and_between_frames():
    wire = b"".join(encode_frame(f) for f in stream()[:3])
    decoder = FrameDecoder()
    decoder.feed(wire)
    with pytest.raises(TruncatedStreamError, match="without an END"):
        decoder.close()
    decoder = FrameDecoder()
    decoder.feed(wire[:-3])
    with pytest.raises(TruncatedStreamError, match="inside a frame"):
        decoder.close()


def corrupt(offset: int, value: bytes) -> bytes:
    wire = bytearray(b"".join(encode_frame(f) for f in stream()))
    wire[offset : offset + len(value)] = value
    return bytes(wire)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, b"HTTP", "bad frame magic"),
        (3, b"\x07", "protocol version 7"),
        (4, b"\x09", "unknown frame type"),
        (5, b"\x09", "unknown codec"),
        (8, struct.pack("<I", 5), "sequence jumped"),
        (12, struct.pack("<I", 1 << 30), "meta length"),
        (16, struct.pack("<Q", 1 << 40), "payload length"),
        (FIXED_HEADER_BYTES + 2, b"X", "checksum mismatch"),
    ],
)
def test_malformed_headers_fail_before_allocating(offset, value, message):
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(corrupt(offset, value))


def test_first_frame_must_be_header_and_nothing_follows_the_end():
    with pytest.raises(ProtocolError, match="expected HEADER"):
        FrameDecoder().feed(encode_frame(Frame(FrameType.DATA, 0)))
    wire = b"".join(encode_frame(f) for f in stream())
    with pytest.raises(ProtocolError, match="after the terminal frame"):
        FrameDecoder().feed(wire + encode_frame(Frame(FrameType.HEARTBEAT, 5)))


def test_payload_limit_is_configurable():
    wire = b"".join(encode_frame(f) for f in stream())
    with pytest.raises(ProtocolError, match="payload length 5 over the 4 limit"):
        FrameDecoder(max_payload_bytes=4).feed(wire)


def test_big_frames_fill_their_own_buffer_across_any_chunking():
    import random

    from eagle3.core.protocol.frames import DIRECT_FILL_BYTES

    rng = random.Random(0)
    big = bytes(rng.randrange(256) for _ in range(3 * DIRECT_FILL_BYTES + 7))
    frames = [
        Frame(FrameType.HEADER, 0, {"n": 1}),
        Frame(FrameType.DATA, 1, {"i": 1}, big, Codec.NONE),
        Frame(FrameType.HEARTBEAT, 2, {}),
        Frame(FrameType.DATA, 3, {"i": 3}, big[::-1], Codec.ZSTD),
        Frame(FrameType.END, 4, {"n_frames": 5}),
    ]
    wire = b"".join(encode_frame(f) for f in frames)
    for max_chunk in (1, 97, 70_000, len(wire)):
        decoder, got, pos = FrameDecoder(), [], 0
        while pos < len(wire):
            step = rng.randint(1, max_chunk) if max_chunk > 1 else 1
            if max_chunk == 1 and 100 < pos < len(wire) - 100:
                step = rng.randint(1, 5000)  # byte-at-a-time only around the edges: keep it quick
            got += decoder.feed(wire[pos : pos + step])
            pos += step
        decoder.close()
        assert [(f.type, f.seq, f.meta, bytes(f.payload), f.codec) for f in got] == [
            (f.type, f.seq, f.meta, bytes(f.payload), f.codec) for f in frames
        ]
    corrupt = bytearray(wire)
    corrupt[len(encode_frame(frames[0])) + 32 + 20 + DIRECT_FILL_BYTES] ^= 1  # inside the big payload
    decoder = FrameDecoder()

    def feed_all() -> None:
        for i in range(0, len(corrupt), 65536):
            decoder.feed(bytes(corrupt[i : i + 65536]))

    with pytest.raises(ProtocolError, match="checksum"):
        feed_all()
    decoder = FrameDecoder()
    decoder.feed(wire[: len(encode_frame(frames[0])) + 100_000])  # stops inside the big body
    with pytest.raises(TruncatedStreamError):
        decoder.close()
