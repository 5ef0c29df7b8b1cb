"""The ``/v1/extract`` response body: HEADER, DATA / SAMPLE_ERROR / HEARTBEAT, then END or ERROR.

Each finished sample becomes one or more DATA frames: a safetensors blob per token range
(``hidden_states`` BF16 ``[n, L+1, H]``, ``input_ids`` I32, ``loss_mask`` U8), at most
``max_payload_bytes`` raw, encoded with ``eagle3.core.codec.encode_payload`` in a worker thread (never on the
event loop). Frames are coalesced into HTTP writes of about ``stream_chunk_bytes``. The stream's budget
goes back to the scheduler as each sample is written, and all of it in ``close`` (exactly once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from eagle3.core.codec import RawTensor, build_safetensors, encode_payload
from eagle3.core.protocol.frames import CONTENT_TYPE, PROTOCOL_VERSION, Codec, Frame, FrameType, encode_frame
from eagle3.server.backends import BackendInfo
from eagle3.server.metrics import Metrics
from eagle3.server.request_log import log_finished_request
from eagle3.server.scheduler import Request, Result, Scheduler

logger = logging.getLogger(__name__)
SAFETENSORS_HEADER_BYTES = 512  # generous bound on the JSON header of one blob


@dataclass(frozen=True)
class EncodeOptions:
    codec: Codec
    zstd_level: int
    max_payload_bytes: int


def stream_header(
    info: BackendInfo, request_id: str, n_samples: int, n_tokens: int, max_payload_bytes: int
) -> dict[str, Any]:
    """The HEADER frame's meta (docs/protocol.md): what every DATA frame of the stream holds."""
    return {
        "protocol": PROTOCOL_VERSION,
        "request_id": request_id,
        "model_id": info.model_id,
        "revision": info.revision,
        "aux_layer_ids": list(info.aux_layer_ids),
        "final_layer_id": info.final_layer_id,
        "final_norm_applied": False,
        "dtype": "bfloat16",
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "tokenizer_sha256": info.tokenizer_sha256,
        "n_samples": n_samples,
        "n_tokens": n_tokens,
        "max_payload_bytes": max_payload_bytes,
    }


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor (bf16 via its int16 view; no copy)."""
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.ascontiguousarray(arr).data.cast("B")


def sample_blobs(result: Result, max_payload_bytes: int) -> list[tuple[int, int, bytes]]:
    """``(token_start, token_end, safetensors blob)`` covering the sample, each blob within the limit."""
    states = result.states.to(torch.bfloat16).contiguous()  # [n, L+1, H]
    n_tokens, n_layers, hidden = states.shape
    ids = np.asarray(result.sample.input_ids, dtype="<i4")
    mask = np.asarray(result.sample.loss_mask, dtype=np.uint8)
    per_token = n_layers * hidden * 2 + 4 + 1
    step = max(1, (max_payload_bytes - SAFETENSORS_HEADER_BYTES) // per_token)
    out = []
    for start in range(0, n_tokens, step):
        end = min(n_tokens, start + step)
        tensors = {
            "hidden_states": RawTensor("BF16", (end - start, n_layers, hidden), tensor_bytes(states[start:end])),
            "input_ids": RawTensor("I32", (end - start,), ids[start:end].data.cast("B")),
            "loss_mask": RawTensor("U8", (end - start,), mask[start:end].data.cast("B")),
        }
        out.append((start, end, b"".join(build_safetensors(tensors))))
    return out


def encode_result(result: Result, seq: int, opts: EncodeOptions) -> tuple[list[bytes], int, int]:
    """Frames for one sample (runs in a worker thread): ``(frames, raw_bytes, payload_bytes)``."""
    sample = result.sample
    if result.error is not None:
        meta = {"sample_id": sample.sample_id, "sample_index": sample.index, "error": result.error}
        return [encode_frame(Frame(FrameType.SAMPLE_ERROR, seq, meta))], 0, 0
    frames, raw_total, wire_total = [], 0, 0
    blobs = sample_blobs(result, opts.max_payload_bytes)
    for k, (start, end, blob) in enumerate(blobs):
        payload, codec = encode_payload(blob, opts.codec, opts.zstd_level), opts.codec
        if codec != Codec.NONE and len(payload) >= len(blob) and len(blob) <= opts.max_payload_bytes:
            payload, codec = blob, Codec.NONE  # incompressible: send it as is
        meta = {
            "sample_id": sample.sample_id,
            "sample_index": sample.index,
            "token_start": start,
            "token_end": end,
            "n_tokens": sample.n_tokens,
            "final": k == len(blobs) - 1,
            "raw_bytes": len(blob),
        }
        frames.append(encode_frame(Frame(FrameType.DATA, seq + k, meta, payload, codec)))
        raw_total += len(blob)
        wire_total += len(payload)
    return frames, raw_total, wire_total


class ExtractStream:
    def __init__(
        self,
        sched: Scheduler,
        req: Request,
        header: dict[str, Any],
        opts: EncodeOptions,
        executor: Executor,
        metrics: Metrics,
        heartbeat_s: float,
        chunk_bytes: int,
    ) -> None:
        self.sched, self.req, self.header, self.opts = sched, req, header, opts
        self.executor, self.metrics = executor, metrics
        self.heartbeat_s, self.chunk_bytes = heartbeat_s, chunk_bytes
        self.seq = 0
        self.counts = {"n_samples": 0, "n_failed": 0, "n_tokens": 0, "payload_bytes": 0, "raw_bytes": 0}
        self.completed: list[str] = []
        self.outcome = "cancelled"  # ok | partial (some SAMPLE_ERROR) | aborted | error | cancelled (client left)
        self._finished = False

    def _frame(self, ftype: FrameType, meta: dict[str, Any]) -> bytes:
        data = encode_frame(Frame(ftype, self.seq, meta))
        self.seq += 1
        return data

    def close(self) -> None:
        self.sched.close(self.req)
        if not self._finished:  # called twice (stream finally, response finally): one log line
            self._finished = True
            log_finished_request(self.req, self.counts, self.outcome)

    async def body(self) -> AsyncIterator[bytes | memoryview]:
        loop = asyncio.get_running_loop()
        req = self.req
        out: list[bytes] = [self._frame(FrameType.HEADER, self.header)]
        n_left = len(req.samples)
        try:
            while n_left:
                if sum(map(len, out)):
                    for piece in self._pieces(out):
                        yield piece
                    out = []
                results = await req.next_results(self.heartbeat_s)
                if req.abort_error is not None:
                    meta = {"error": req.abort_error, "completed_sample_ids": self.completed}
                    self.outcome = "aborted"
                    yield self._frame(FrameType.ERROR, meta)
                    return
                if not results:
                    out.append(self._frame(FrameType.HEARTBEAT, {}))
                    continue
                for result in results:
                    frames, raw, wire = await loop.run_in_executor(
                        self.executor, encode_result, result, self.seq, self.opts
                    )
                    self.seq += len(frames)
                    self.sched.consumed(req, result)
                    self._count(result, raw, wire)
                    out.extend(frames)
                    n_left -= 1
                    if sum(map(len, out)) >= self.chunk_bytes:
                        for piece in self._pieces(out):
                            yield piece
                        out = []
                    self.sched.release(req, result.sample.n_tokens)  # streamed out (or buffered in `out`)
            out.append(self._frame(FrameType.END, {"n_frames": self.seq + 1, **self.counts}))
            self.outcome = "partial" if self.counts["n_failed"] else "ok"
            for piece in self._pieces(out):
                yield piece
        except Exception as exc:
            logger.exception("request %s: stream failed", req.request_id)
            self.outcome = "error"
            self.metrics.note_error("internal", req.tenant, req.request_id, f"stream failed: {exc}")
            error = {"type": "internal", "message": f"server error while streaming: {exc}"[:500], "retryable": True}
            yield self._frame(FrameType.ERROR, {"error": error, "completed_sample_ids": self.completed})
        finally:
            self.close()

    def _count(self, result: Result, raw: int, wire: int) -> None:
        if result.error is None:
            self.counts["n_samples"] += 1
            self.counts["n_tokens"] += result.sample.n_tokens
            self.completed.append(result.sample.sample_id)
            self.metrics.inc("eagle3_samples_total", tenant=self.req.tenant, outcome="ok")
        else:
            self.counts["n_failed"] += 1
            self.metrics.inc("eagle3_samples_total", tenant=self.req.tenant, outcome="failed")
            error = result.error or {}
            self.metrics.note_error(str(error.get("type", "sample_error")), self.req.tenant, self.req.request_id,
                                    f"sample {result.sample.sample_id!r}: {error.get('message', '')}")  # fmt: skip
        self.counts["payload_bytes"] += wire
        self.counts["raw_bytes"] += raw
        self.metrics.inc("eagle3_stream_bytes_total", wire, tenant=self.req.tenant, kind="wire")
        self.metrics.inc("eagle3_stream_bytes_total", raw, tenant=self.req.tenant, kind="raw")
        if self.counts["n_samples"] + self.counts["n_failed"] == 1:
            self.metrics.observe("eagle3_time_to_first_sample_seconds", time.monotonic() - self.req.admitted_at)

    def _pieces(self, frames: list[bytes]) -> list[bytes | memoryview]:
        """Small frames joined, big ones sliced: HTTP writes of about ``chunk_bytes`` each."""
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        view = memoryview(data)
        return [view[i : i + self.chunk_bytes] for i in range(0, len(data), self.chunk_bytes)]


class FrameStreamResponse(StreamingResponse):
    """A StreamingResponse that closes its stream when the response ends for any reason (the client
    vanished while the generator sat at a ``yield`` included), so budget always comes back."""

    def __init__(self, stream: ExtractStream, headers: dict[str, str]) -> None:
        super().__init__(stream.body(), media_type=CONTENT_TYPE, headers=headers)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()
