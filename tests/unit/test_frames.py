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
