"""The ``/v1/extract`` response stream: self-delimiting binary frames (sans-IO, stdlib only).

A stream is ``Frame*``: HEADER first, then DATA / SAMPLE_ERROR / HEARTBEAT frames in any order,
and END or ERROR last. A stream that stops without END or ERROR is truncated (retryable).
Every frame is a 32-byte little-endian fixed header, ``meta_len`` bytes of UTF-8 JSON, then
``payload_len`` bytes of payload::

    offset size field
    0      4    magic        b"E3F" + protocol version byte (0x02)
    4      1    type         FrameType
    5      1    codec        Codec of the payload (NONE for frames without payload)
    6      2    flags        reserved, 0
    8      4    seq          u32, 0 for HEADER, +1 per frame
    12     4    meta_len     u32, <= MAX_META_BYTES
    16     8    payload_len  u64, <= the decoder's max_payload_bytes
    24     4    crc32        zlib.crc32 over header[0:24] || header[28:32] || meta || payload
    28     4    reserved     0

The checksum covers every byte of the frame but its own four (version 2; version 1 left the header
out, so one flipped bit in a length or a seq could turn a delivered sample into a failure).
Invariants enforced by ``FrameDecoder`` *before* it allocates or parses anything: magic and version,
known type and codec, flags and reserved 0, ``seq`` strictly +1, both lengths within bounds; then the
checksum, before the meta is parsed. The payload codec (zstd, byte-plane shuffle) lives in
``eagle3.core.codec``: this module only moves bytes. ``frame_head`` lets the server
write a payload's parts right after it without joining them (no copy of large tensors).
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3.core.errors import Eagle3Error

Buffer = bytes | bytearray | memoryview  # anything zlib.crc32 and a socket write take
Crc32 = Callable[[Buffer, int], int]  # zlib.crc32's signature and result (any implementation of CRC-32)
Allocate = Callable[[int], Any]  # n -> a writable buffer of n bytes (its contents are overwritten)

PROTOCOL_VERSION = 2
MAGIC = b"E3F" + bytes([PROTOCOL_VERSION])
CONTENT_TYPE = f"application/x-eagle3-frames; version={PROTOCOL_VERSION}"
FIXED_HEADER = struct.Struct("<4sBBHIIQII")  # magic type codec flags seq meta_len payload_len crc32 reserved
FIXED_HEADER_BYTES = FIXED_HEADER.size  # 32
CRC_OFFSET = 24  # the checksum's own bytes, [24, 28), are the only ones it does not cover
MAX_META_BYTES = 1 << 20  # 1 MiB of JSON
DEFAULT_MAX_PAYLOAD_BYTES = 256 << 20  # 256 MiB per frame (the server chunks longer samples)
DIRECT_FILL_BYTES = 256 << 10  # FrameDecoder: bodies this big skip the shared buffer (one copy, not two)


class FrameType(enum.IntEnum):
    HEADER = 1  # meta: StreamHeader fields; no payload
    DATA = 2  # meta: {sample_id, sample_index, token_start, token_end, n_tokens, final, raw_bytes}
    HEARTBEAT = 3  # meta: {} ; sent while the request waits or computes
    ERROR = 4  # meta: {error: {type, message, retryable, ...}, completed_sample_ids}; terminal
    END = 5  # meta: {n_frames, n_samples, n_failed, n_tokens, payload_bytes, raw_bytes}; terminal
    SAMPLE_ERROR = 6  # meta: {sample_id, sample_index, error: {type, message, retryable}}; not terminal


TERMINAL = frozenset({FrameType.END, FrameType.ERROR})


class Codec(enum.IntEnum):
    NONE = 0  # payload is the raw safetensors blob
    ZSTD = 1  # one zstd frame (content size + checksum) of the blob
    ZSTD_SHUFFLE = 2  # blob split into even-byte plane || odd-byte plane, then zstd
    ZSTD_PLANES = 3  # u32 n || zstd(even-byte plane) (n bytes) || zstd(odd-byte plane): two separate frames


CODEC_NAMES = {
    "none": Codec.NONE,
    "zstd": Codec.ZSTD,
    "zstd+shuffle": Codec.ZSTD_SHUFFLE,
    "zstd+planes": Codec.ZSTD_PLANES,
}


class ProtocolError(Eagle3Error):
    """The byte stream is not a valid frame stream (never retry against the same server blindly)."""


class TruncatedStreamError(ProtocolError):
    """The stream ended inside a frame or before its END/ERROR frame (retryable)."""


@dataclass(frozen=True)
class Frame:
    type: FrameType
    seq: int
    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer = b""
    codec: Codec = Codec.NONE


def head_crc(head: Buffer, crc32: Crc32 = zlib.crc32) -> int:
    """CRC-32 of a fixed header without its checksum field: the start of every frame's checksum."""
    with memoryview(head) as h:
        return crc32(h[CRC_OFFSET + 4 : FIXED_HEADER_BYTES], crc32(h[:CRC_OFFSET], 0))


def frame_crc(head: Buffer, meta: Buffer, payload_parts: Sequence[Buffer], crc32: Crc32 = zlib.crc32) -> int:
    """CRC-32 of a frame: its fixed header without the checksum field, then meta, then the payload.
    ``crc32``: any implementation with ``zlib.crc32``'s signature and results (a faster one may be given)."""
    crc = crc32(meta, head_crc(head, crc32))
    for part in payload_parts:
        crc = crc32(part, crc)
    return crc


def frame_head(
    ftype: FrameType,
    seq: int,
    meta: dict[str, Any],
    payload_parts: Sequence[Buffer] = (),
    codec: Codec = Codec.NONE,
    crc32: Crc32 = zlib.crc32,
) -> bytes:
    """Fixed header + meta of a frame whose payload is ``payload_parts`` concatenated. The parts are
    not copied: the caller writes them right after the head (the server streams big tensors this way)."""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    if len(meta_bytes) > MAX_META_BYTES:
        raise ProtocolError(f"frame meta is {len(meta_bytes)} bytes, over the {MAX_META_BYTES} limit")
    payload_len = sum(memoryview(part).nbytes for part in payload_parts)
    head = bytearray(FIXED_HEADER.pack(MAGIC, ftype, codec, 0, seq, len(meta_bytes), payload_len, 0, 0))
    head[CRC_OFFSET : CRC_OFFSET + 4] = frame_crc(head, meta_bytes, payload_parts, crc32).to_bytes(4, "little")
    return bytes(head) + meta_bytes


def encode_frame(frame: Frame) -> bytes:
    """Serialize one frame (header + meta + payload) into a single bytes object."""
    return b"".join((frame_head(frame.type, frame.seq, frame.meta, (frame.payload,), frame.codec), frame.payload))


class FrameDecoder:
    """Incremental parser: ``feed(chunk)`` returns the frames completed so far; ``close()`` at EOF.

    Chunk boundaries are arbitrary (HTTP chunks do not align with frames). Bounds are checked on the
    fixed header before the body is buffered, so a corrupt length cannot make it allocate gigabytes.
    A body of at least ``DIRECT_FILL_BYTES`` is copied once, straight from the chunks into a buffer
    of its own (``allocate(n)``: ``bytearray`` by default; the SDK passes numpy's, which skips the
    zero fill and maps huge pages), and checksummed piece by piece as it arrives (``crc32``:
    ``zlib.crc32`` or any implementation with its signature and results), while each piece is still
    in the CPU cache; its frame's payload is a memoryview of that buffer. The checksum is still
    compared before the meta is parsed.
    """

    def __init__(
        self,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        *,
        crc32: Crc32 = zlib.crc32,
        allocate: Allocate = bytearray,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self._crc32 = crc32
        self._allocate = allocate
        self._buf = bytearray()
        self._next_seq = 0
        self._pending: tuple[int, int, int, int, int, int] | None = None  # type codec seq meta_len payload_len crc
        self._pending_head = b""  # the pending frame's fixed header bytes (checksummed with its body)
        self._body: memoryview | None = None  # a big pending frame's meta + payload, filled in place
        self._body_filled = 0
        self._body_crc = 0  # checksum of the header and of the body bytes filled so far
        self.finished = False  # a terminal frame was seen

    def feed(self, chunk: Buffer) -> list[Frame]:
        """Frames completed by ``chunk``. Each payload byte is copied once: a frame body of at least
        ``DIRECT_FILL_BYTES`` goes straight from the chunks into its own buffer (the payload is then a
        memoryview of it); smaller frames pass through a shared buffer and are copied out of it."""
        if chunk and self.finished:
            raise ProtocolError("bytes after the terminal frame")
        data = memoryview(chunk).cast("B")
        frames: list[Frame] = []
        if self._body is not None:
            filled = self._body_filled
            n = min(len(self._body) - filled, len(data))
            piece = data[:n]
            self._body[filled : filled + n] = piece
            self._body_crc = self._crc32(piece, self._body_crc)
            self._body_filled = filled + n
            if self._body_filled < len(self._body):
                return frames
            body, self._body = self._body, None
            frames.append(self._complete(body, self._body_crc))
            data = data[n:]
            if self.finished and len(data):
                raise ProtocolError("bytes after the terminal frame")
        if len(data):
            self._buf += data
            frames += self._parse_buffer()
        return frames

    def _parse_buffer(self) -> list[Frame]:
        frames: list[Frame] = []
        offset = 0
        with memoryview(self._buf) as view:  # released before the buffer is trimmed below
            while True:
                if self._pending is None:
                    if len(view) - offset < FIXED_HEADER_BYTES:
                        break
                    self._pending = self._parse_header(offset)
                    offset += FIXED_HEADER_BYTES
                body_len = self._pending[3] + self._pending[4]
                if len(view) - offset < body_len:
                    if body_len >= DIRECT_FILL_BYTES:  # fill its own buffer from here on
                        self._start_body(body_len, view[offset:])
                        offset = len(view)
                    break
                with view[offset : offset + body_len] as body:
                    meta_len = self._pending[3]
                    crc = frame_crc(self._pending_head, body[:meta_len], (body[meta_len:],), self._crc32)
                    frames.append(self._complete(body, crc, copy=True))
                offset += body_len
                if self.finished:
                    if offset != len(view):
                        raise ProtocolError("bytes after the terminal frame")
                    break
        if offset == len(self._buf):
            self._buf = bytearray()  # drop the consumed bytes without moving anything
        elif offset:
            del self._buf[:offset]
        return frames

    def _start_body(self, body_len: int, first: memoryview) -> None:
        body = memoryview(self._allocate(body_len)).cast("B")
        if len(body) != body_len or body.readonly:
            raise ValueError(f"allocate({body_len}) returned {len(body)} bytes (readonly={body.readonly})")
        body[: len(first)] = first
        self._body = body
        self._body_filled = len(first)
        self._body_crc = self._crc32(first, head_crc(self._pending_head, self._crc32))

    def _complete(self, body: memoryview, crc: int, copy: bool = False) -> Frame:
        """The pending frame from its meta + payload bytes and their checksum (header included):
        compare, then parse the meta; ``copy`` when ``body`` is a view of the shared buffer (the
        payload must outlive it)."""
        assert self._pending is not None
        ftype, codec, seq, meta_len, _payload_len, want_crc = self._pending
        self._pending = None
        if crc != want_crc:
            raise ProtocolError(f"frame {seq}: checksum mismatch")
        meta_view, payload_view = body[:meta_len], body[meta_len:]
        meta_bytes = meta_view.tobytes()
        payload: Buffer = payload_view.tobytes() if copy else payload_view
        try:
            meta = json.loads(meta_bytes) if meta_bytes else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"frame {seq}: meta is not JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"frame {seq}: meta is not a JSON object")
        frame = Frame(FrameType(ftype), seq, meta, payload, Codec(codec))
        if frame.type in TERMINAL:
            self.finished = True
        return frame

    def close(self) -> None:
        """Call at end of stream: raises TruncatedStreamError unless a terminal frame closed it cleanly."""
        if self._buf or self._pending is not None or self._body is not None:
            raise TruncatedStreamError("stream ended inside a frame")
        if not self.finished:
            raise TruncatedStreamError("stream ended without an END or ERROR frame")

    def _parse_header(self, offset: int) -> tuple[int, int, int, int, int, int]:
        magic, ftype, codec, flags, seq, meta_len, payload_len, crc, reserved = FIXED_HEADER.unpack_from(
            self._buf, offset
        )
        self._pending_head = bytes(self._buf[offset : offset + FIXED_HEADER_BYTES])
        if magic[:3] != MAGIC[:3]:
            raise ProtocolError(f"bad frame magic {magic!r} (not an eagle3 frame stream)")
        if magic[3] != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {magic[3]} not supported (this client speaks {PROTOCOL_VERSION})")
        if ftype not in FrameType.__members__.values():
            raise ProtocolError(f"frame {seq}: unknown frame type {ftype}")
        if codec not in Codec.__members__.values():
            raise ProtocolError(f"frame {seq}: unknown codec {codec}")
        if flags or reserved:
            raise ProtocolError(f"frame {seq}: reserved header fields are not 0 (flags {flags}, reserved {reserved})")
        if seq != self._next_seq:
            raise ProtocolError(f"frame sequence jumped from {self._next_seq - 1} to {seq}")
        if seq == 0 and ftype not in (FrameType.HEADER, FrameType.ERROR):
            raise ProtocolError(f"first frame is {FrameType(ftype).name}, expected HEADER")
        if meta_len > MAX_META_BYTES:
            raise ProtocolError(f"frame {seq}: meta length {meta_len} over the {MAX_META_BYTES} limit")
        if payload_len > self.max_payload_bytes:
            raise ProtocolError(f"frame {seq}: payload length {payload_len} over the {self.max_payload_bytes} limit")
        self._next_seq += 1
        return ftype, codec, seq, meta_len, payload_len, crc
