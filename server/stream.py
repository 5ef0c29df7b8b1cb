"""The ``/v1/extract`` response body: HEADER, DATA / SAMPLE_ERROR / HEARTBEAT, then END or ERROR.

Each finished sample becomes one or more DATA frames: a safetensors blob per token range
(``hidden_states`` BF16 ``[n, L+1, H]``, ``input_ids`` I32, ``loss_mask`` U8; a request for FP8 gets
``hidden_states`` F8_E4M3 and ``hidden_scales`` F32 ``[n, L+1]`` instead, quantized from the bf16
states, bit for bit as ``eagle3.core.fp8.quantize_states`` does), at most
``max_payload_bytes`` raw, encoded with ``eagle3.core.codec.encode_payload`` in a worker thread (never on the
event loop). Frames are coalesced into HTTP writes of about ``stream_chunk_bytes``. The stream's budget
goes back to the scheduler as each sample is written, and all of it in ``close`` (exactly once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from eagle3.core.checksum import crc32
from eagle3.core.codec import RawTensor, build_safetensors, encode_payload
from eagle3.core.protocol.error_types import error_meta
from eagle3.core.protocol.frames import (
    CONTENT_TYPE,
    Codec,
    Frame,
    FrameType,
    encode_frame,
    frame_head,
)
from eagle3.core.protocol.wire import AbortMeta, DataMeta, EndMeta, ErrorInfo, SampleErrorMeta, StreamHeader
from eagle3.server.backends import BackendInfo
from eagle3.server.metrics import Metrics
from eagle3.server.request_log import log_finished_request
from eagle3.server.request_state import Request, Result
from eagle3.server.scheduler import Scheduler

logger = logging.getLogger(__name__)
SAFETENSORS_HEADER_BYTES = 512  # generous bound on the JSON header of one blob


@dataclass(frozen=True)
class EncodeOptions:
    codec: Codec
    zstd_level: int
    max_payload_bytes: int
    fp8: bool = False  # the request asked for "dtype": "float8_e4m3fn"


def stream_header(
    info: BackendInfo, request_id: str, n_samples: int, n_tokens: int, max_payload_bytes: int
) -> StreamHeader:
    """The HEADER frame's meta (docs/protocol.md): what every DATA frame of the stream holds."""
    return StreamHeader(
        request_id=request_id,
        **info.identity.as_fields(),
        n_samples=n_samples,
        n_tokens=n_tokens,
        max_payload_bytes=max_payload_bytes,
    )


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor (bf16 via its int16 view; no copy)."""
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.ascontiguousarray(arr).data.cast("B")


def tokens_per_blob(n_layers: int, hidden: int, max_payload_bytes: int, fp8: bool = False) -> int:
    """Tokens per DATA frame so that one frame's raw blob stays within ``max_payload_bytes``."""
    per_token = (n_layers * (hidden + 4) if fp8 else n_layers * hidden * 2) + 4 + 1
    return max(1, (max_payload_bytes - SAFETENSORS_HEADER_BYTES) // per_token)


def n_frames(result: Result, max_payload_bytes: int, fp8: bool = False) -> int:
    """Frames ``encode_result`` makes for ``result`` (known before it runs, so seqs can be handed out)."""
    if result.error is not None:
        return 1
    n_tokens, n_layers, hidden = result.states.shape
    return -(-int(n_tokens) // tokens_per_blob(int(n_layers), int(hidden), max_payload_bytes, fp8))


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 states ``[n, L, H]`` -> (e4m3fn codes as uint8 ``[n, L, H]``, float32 scales ``[n, L]``):
    ``eagle3.core.fp8.quantize_states`` in torch (the same IEEE float32 division and rounding, so the
    same bytes; ``tests/e2e/test_fp8_extract.py``), on the states' device."""
    x = states.float()
    amax = x.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    codes = (x / scales.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.cpu().contiguous(), scales.cpu().contiguous()


Chunk = bytes | memoryview  # what the response body yields (starlette takes both)


def sample_blobs(result: Result, max_payload_bytes: int, fp8: bool = False) -> list[tuple[int, int, list[Chunk]]]:
    """``(token_start, token_end, safetensors blob as parts)`` covering the sample, each within the limit.
    The parts are views of the states (no copy); write them in order."""
    states = result.states.to(torch.bfloat16).contiguous()  # [n, L+1, H]; no copy when already bf16
    n_tokens, n_layers, hidden = states.shape
    ids = np.asarray(result.sample.input_ids, dtype="<i4")
    mask = np.asarray(result.sample.loss_mask, dtype=np.uint8)
    step = tokens_per_blob(n_layers, hidden, max_payload_bytes, fp8)
    codes, scales = quantize_fp8(states) if fp8 else (states, None)
    out = []
    for start in range(0, n_tokens, step):
        end = min(n_tokens, start + step)
        tensors = {
            "hidden_states": RawTensor(
                "F8_E4M3" if fp8 else "BF16", (end - start, n_layers, hidden), tensor_bytes(codes[start:end])
            ),
        }
        if scales is not None:
            tensors["hidden_scales"] = RawTensor("F32", (end - start, n_layers), tensor_bytes(scales[start:end]))
        tensors |= {
            "input_ids": RawTensor("I32", (end - start,), ids[start:end].data.cast("B")),
            "loss_mask": RawTensor("U8", (end - start,), mask[start:end].data.cast("B")),
        }
        out.append((start, end, build_safetensors(tensors)))
    return out


@dataclass
class Encoded:
    """One sample's frames as parts to write in order, with its byte counts and stage times."""

    parts: list[Chunk]
    raw_bytes: int
    wire_bytes: int
    copy_s: float
    encode_s: float


def encode_result(result: Result, seq: int, opts: EncodeOptions) -> Encoded:
    """Frames for one sample, numbered from ``seq`` (runs in an encoder thread). Codec ``none`` sends
    the states' own memory: the frame head, then the blob's parts, nothing concatenated."""
    sample = result.sample
    if result.error is not None:
        meta = SampleErrorMeta(sample.sample_id, sample.index, ErrorInfo.from_dict(result.error)).to_dict()
        return Encoded([encode_frame(Frame(FrameType.SAMPLE_ERROR, seq, meta))], 0, 0, 0.0, 0.0)
    started = time.perf_counter()
    blobs = sample_blobs(result, opts.max_payload_bytes, opts.fp8)
    copied = time.perf_counter()
    parts: list[Chunk] = []
    raw_total, wire_total = 0, 0
    for k, (start, end, blob_parts) in enumerate(blobs):
        raw = sum(memoryview(p).nbytes for p in blob_parts)
        payload: list[Chunk] = list(blob_parts)
        codec = opts.codec
        if codec != Codec.NONE:
            compressed = encode_payload(b"".join(blob_parts), codec, opts.zstd_level)
            if len(compressed) >= raw:
                codec = Codec.NONE  # incompressible: send it as is
            else:
                payload = [compressed]
        meta = DataMeta(sample.sample_id, sample.index, start, end, sample.n_tokens, k == len(blobs) - 1, raw).to_dict()
        parts.append(frame_head(FrameType.DATA, seq + k, meta, payload, codec, crc32=crc32))  # zlib-ng: same CRC
        parts.extend(payload)
        raw_total += raw
        wire_total += sum(memoryview(p).nbytes for p in payload)
    return Encoded(parts, raw_total, wire_total, copied - started, time.perf_counter() - copied)


class ExtractStream:
    """One response body. Results are encoded on the shared encoder pool as soon as they arrive, all of
    a forward pass's samples at once (in parallel), and written in arrival order; frame seqs are handed
    out when a result is submitted (``n_frames``), so the order on the wire is fixed before encoding."""

    def __init__(
        self,
        sched: Scheduler,
        req: Request,
        header: StreamHeader,
        opts: EncodeOptions,
        executor: Executor,
        metrics: Metrics,
        heartbeat_s: float,
        chunk_bytes: int,
    ) -> None:
        self.sched, self.req, self.header, self.opts = sched, req, header, opts
        self.executor, self.metrics = executor, metrics
        self.heartbeat_s, self.chunk_bytes = heartbeat_s, chunk_bytes
        self.seq = 0  # next seq to hand out
        self.sent_seq = 0  # next seq to reach the wire (terminal frames use it)
        self.counts = {"n_samples": 0, "n_failed": 0, "n_tokens": 0, "payload_bytes": 0, "raw_bytes": 0}
        self.completed: list[str] = []
        self.outcome = "cancelled"  # ok | partial (some SAMPLE_ERROR) | aborted | error | cancelled (client left)
        self._finished = False

    def _frame(self, ftype: FrameType, meta: dict[str, Any]) -> bytes:
        data = encode_frame(Frame(ftype, self.seq, meta))
        self.seq += 1
        return data

    def _terminal(self, ftype: FrameType, meta: dict[str, Any]) -> bytes:
        """END or ERROR, numbered after the last frame written (encodes still pending are dropped)."""
        self.seq = self.sent_seq
        return self._frame(ftype, meta)

    def close(self) -> None:
        self.sched.close(self.req)
        if not self._finished:  # called twice (stream finally, response finally): one log line
            self._finished = True
            log_finished_request(self.req, self.counts, self.outcome)

    async def body(self) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        req = self.req
        encoding: deque[tuple[Result, int, asyncio.Future[Encoded]]] = deque()
        yield self._frame(FrameType.HEADER, self.header.to_dict())
        self.sent_seq = self.seq
        n_left = len(req.samples)
        out: list[Chunk] = []
        out_bytes, out_frames = 0, 0  # in `out`, not written yet
        unreleased: list[Result] = []
        try:
            while n_left:
                results = req.take_results() if encoding else await req.next_results(self.heartbeat_s)
                if req.abort_error is not None:
                    for piece in self._pieces(out):
                        yield piece
                    self.sent_seq += out_frames
                    abort = AbortMeta(ErrorInfo.from_dict(req.abort_error), tuple(self.completed))
                    self.outcome = "aborted"
                    yield self._terminal(FrameType.ERROR, abort.to_dict())
                    return
                for result in results:
                    future = loop.run_in_executor(self.executor, encode_result, result, self.seq, self.opts)
                    count = n_frames(result, self.opts.max_payload_bytes, self.opts.fp8)
                    self.seq += count
                    encoding.append((result, count, future))
                if not encoding:
                    heartbeat = self._frame(FrameType.HEARTBEAT, {})
                    self.sent_seq = self.seq
                    yield heartbeat
                    continue
                result, count, future = encoding.popleft()
                encoded = await future
                self.sched.consumed(req, result)
                self._count(result, encoded)
                out.extend(encoded.parts)
                out_bytes += encoded.wire_bytes
                out_frames += count
                unreleased.append(result)
                n_left -= 1
                if out_bytes >= self.chunk_bytes or not encoding or not encoding[0][2].done():
                    pieces, n_frames_out = self._pieces(out), out_frames
                    out, out_bytes, out_frames = [], 0, 0
                    started = time.perf_counter()
                    for piece in pieces:
                        yield piece
                    self.metrics.inc("eagle3_stage_seconds_total", time.perf_counter() - started, stage="send")
                    self.sent_seq += n_frames_out
                    for done in unreleased:
                        self.sched.release(req, done.sample.n_tokens)
                    unreleased = []
            out.append(self._frame(FrameType.END, EndMeta(n_frames=self.seq + 1, **self.counts).to_dict()))
            self.outcome = "partial" if self.counts["n_failed"] else "ok"
            for piece in self._pieces(out):
                yield piece
        except Exception as exc:
            logger.exception("request %s: stream failed", req.request_id)
            for piece in self._pieces(out):  # the samples counted as completed reach the client first
                yield piece
            self.sent_seq += out_frames
            self.outcome = "error"
            self.metrics.note_error("internal", req.tenant, req.request_id, f"stream failed: {exc}")
            error = ErrorInfo.from_dict(error_meta("internal", f"server error while streaming: {exc}"[:500]))
            yield self._terminal(FrameType.ERROR, AbortMeta(error, tuple(self.completed)).to_dict())
        finally:
            for _, _, future in encoding:
                future.cancel()
            self.close()

    def _count(self, result: Result, encoded: Encoded) -> None:
        if result.error is None:
            self.counts["n_samples"] += 1
            self.counts["n_tokens"] += result.sample.n_tokens
            self.completed.append(result.sample.sample_id)
            self.metrics.inc("eagle3_samples_total", tenant=self.req.tenant, outcome="ok")
        else:
            self.counts["n_failed"] += 1
            self.metrics.inc("eagle3_samples_total", tenant=self.req.tenant, outcome="failed")
            error = result.error or {}
            self.metrics.note_error(
                str(error.get("type", "sample_error")),
                self.req.tenant,
                self.req.request_id,
                f"sample {result.sample.sample_id!r}: {error.get('message', '')}",
            )
        self.counts["payload_bytes"] += encoded.wire_bytes
        self.counts["raw_bytes"] += encoded.raw_bytes
        self.metrics.inc("eagle3_stream_bytes_total", encoded.wire_bytes, tenant=self.req.tenant, kind="wire")
        self.metrics.inc("eagle3_stream_bytes_total", encoded.raw_bytes, tenant=self.req.tenant, kind="raw")
        self.metrics.inc("eagle3_stage_seconds_total", encoded.copy_s, stage="copy")
        self.metrics.inc("eagle3_stage_seconds_total", encoded.encode_s, stage="encode")
        if self.counts["n_samples"] + self.counts["n_failed"] == 1:
            since_s = time.monotonic() - self.req.admitted_at
            self.metrics.observe("eagle3_time_to_first_sample_seconds", since_s, lane=self.req.lane)

    def _pieces(self, parts: list[Chunk]) -> list[Chunk]:
        """HTTP writes of about ``chunk_bytes``: runs of small parts joined, big parts sliced (not copied)."""
        pieces: list[Chunk] = []
        small: list[Chunk] = []
        small_bytes = 0
        for part in parts:
            size = memoryview(part).nbytes
            if size < self.chunk_bytes // 4:
                small.append(part)
                small_bytes += size
                if small_bytes < self.chunk_bytes:
                    continue
                part, size, small, small_bytes = b"".join(small), small_bytes, [], 0
            elif small:
                pieces.append(b"".join(small))
                small, small_bytes = [], 0
            view = memoryview(part).cast("B")
            pieces.extend(view[i : i + self.chunk_bytes] for i in range(0, size, self.chunk_bytes))
        if small:
            pieces.append(b"".join(small))
        return pieces


class FrameStreamResponse(StreamingResponse):
    """A StreamingResponse that closes its stream when the response ends for any reason (the client
    vanished while the generator sat at a ``yield`` included), so budget always comes back."""

    def __init__(
        self, stream: ExtractStream, headers: dict[str, str], on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(stream.body(), media_type=CONTENT_TYPE, headers=headers)
        self.stream = stream
        self.on_close = on_close  # once, when the response ends for any reason (the tenant's connection slot)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()
            on_close, self.on_close = self.on_close, None
            if on_close is not None:
                on_close()
