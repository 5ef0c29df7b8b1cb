"""Frames of one ``/v1/extract`` response -> ``ExtractedSample`` / ``SampleFailure`` (sans-IO).

Checks, in order: the HEADER describes bf16 states of a known shape; every DATA frame names a
requested sample, decodes within its declared ``raw_bytes`` (bounded by the stream's
``max_payload_bytes``), holds exactly ``hidden_states BF16 [m, L, H]``, ``input_ids I32 [m]`` and
``loss_mask U8 [m]`` for its token range, and continues its sample where the last chunk stopped; the
final chunk completes the sample at ``n_tokens``; token-id samples come back with the ids we sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eagle3.client.errors import SampleFailure, StreamError
from eagle3.core.codec import decode_payload, parse_safetensors
from eagle3.core.protocol.frames import DEFAULT_MAX_PAYLOAD_BYTES, Frame, FrameDecoder, FrameType, ProtocolError
from eagle3.core.protocol.wire import AbortMeta, DataMeta, EndMeta, SampleErrorMeta, StreamHeader
from eagle3.core.sample import ExtractedSample

RAW_SLACK_BYTES = 1 << 20  # a chunk's safetensors header on top of max_payload_bytes of tensor data


class StreamAssembler:
    def __init__(self, url: str, requests: list[dict[str, Any]], decoder: FrameDecoder | None = None) -> None:
        self.url = url
        self.expected_ids = {r["id"]: r.get("input_ids") for r in requests}
        self.decoder = decoder
        self.header: StreamHeader | None = None
        self.end: EndMeta | None = None
        self.max_raw_bytes = DEFAULT_MAX_PAYLOAD_BYTES + RAW_SLACK_BYTES
        self._chunks: dict[str, list[tuple[Any, Any, Any]]] = {}  # sample id -> (hidden, ids, mask) so far
        self._next_token: dict[str, int] = {}
        self._done: set[str] = set()
        self._n_delivered = 0
        self._n_failed = 0

    def handle(self, frame: Frame) -> list[ExtractedSample | SampleFailure]:
        if frame.type == FrameType.HEADER:
            self._on_header(frame.meta)
        elif frame.type == FrameType.DATA:
            sample = self._on_data(frame)
            return [sample] if sample is not None else []
        elif frame.type == FrameType.SAMPLE_ERROR:
            return [self._on_sample_error(frame.meta)]
        elif frame.type == FrameType.ERROR:
            abort = AbortMeta.from_dict(frame.meta)
            error = abort.error
            raise StreamError(
                f"{self.url}: server aborted the stream: {error.type}: {error.message}",
                url=self.url,
                request_id=self.header.request_id if self.header else None,
                retryable=error.retryable,
                type=error.type,
                completed_sample_ids=abort.completed_sample_ids,
            )
        elif frame.type == FrameType.END:
            self._on_end(EndMeta.from_dict(frame.meta))
        return []

    def _on_end(self, end: EndMeta) -> None:
        """END's counts must match what this stream delivered (a sample dropped on the way is caught here)."""
        got = (self._n_delivered, self._n_failed)
        if (end.n_samples, end.n_failed) != got:
            raise ProtocolError(
                f"END counts {end.n_samples} samples + {end.n_failed} failed, received {got[0]} + {got[1]}"
            )
        self.end = end

    def _on_header(self, meta: dict[str, Any]) -> None:
        header = StreamHeader.from_dict(meta)
        if header.dtype != "bfloat16":
            raise ProtocolError(f"HEADER dtype {header.dtype!r}; this client reads bfloat16")
        if header.final_norm_applied:
            raise ProtocolError("HEADER says final_norm_applied=true; EAGLE-3 needs the pre-norm final state")
        self.aux_layer_ids = header.aux_layer_ids
        self.final_layer_id = header.final_layer_id
        self.hidden_size = header.hidden_size
        self.max_raw_bytes = min(header.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES) + RAW_SLACK_BYTES
        if self.decoder is not None:
            self.decoder.max_payload_bytes = self.max_raw_bytes  # compressed is never larger than raw+slack
        self.header = header

    def _on_data(self, frame: Frame) -> ExtractedSample | None:
        if self.header is None:
            raise ProtocolError("DATA frame before HEADER")
        try:
            meta = DataMeta.from_dict(frame.meta)
        except ProtocolError as exc:
            raise ProtocolError(f"frame {frame.seq}: {exc}") from None
        sample_id, start, end, n_total = meta.sample_id, meta.token_start, meta.token_end, meta.n_tokens
        final, raw_bytes = meta.final, meta.raw_bytes
        if sample_id not in self.expected_ids or sample_id in self._done:
            raise ProtocolError(f"frame {frame.seq}: sample {sample_id!r} was not requested or came twice")
        if start != self._next_token.get(sample_id, 0) or not start < end <= n_total or final != (end == n_total):
            raise ProtocolError(
                f"frame {frame.seq}: sample {sample_id!r} chunk {start}:{end} of {n_total} out of order"
            )
        if not 0 < raw_bytes <= self.max_raw_bytes:
            raise ProtocolError(f"frame {frame.seq}: raw_bytes {raw_bytes} over the {self.max_raw_bytes} bound")
        tensors, _ = parse_safetensors(decode_payload(frame.payload, frame.codec, raw_bytes))
        n = end - start
        n_layers = len(self.aux_layer_ids) + 1
        want = {"hidden_states": ("BF16", (n, n_layers, self.hidden_size)), "input_ids": ("I32", (n,)),
                "loss_mask": ("U8", (n,))}  # fmt: skip
        for name, (dtype, shape) in want.items():
            got = tensors.get(name)
            if got is None or got.dtype != dtype or got.shape != shape:
                found = None if got is None else f"{got.dtype} {list(got.shape)}"
                raise ProtocolError(f"frame {frame.seq}: {name} is {found}, expected {dtype} {list(shape)}")
        parts = (tensors["hidden_states"].numpy(), tensors["input_ids"].numpy(), tensors["loss_mask"].numpy())
        self._next_token[sample_id] = end
        if not final:
            self._chunks.setdefault(sample_id, []).append(parts)
            return None
        chunks = [*self._chunks.pop(sample_id, []), parts]
        hidden, ids, mask = (c[0] if len(chunks) == 1 else np.concatenate(c) for c in zip(*chunks, strict=True))
        expected = self.expected_ids[sample_id]
        if expected is not None and (len(expected) != n_total or not np.array_equal(ids, expected)):
            raise ProtocolError(f"sample {sample_id!r}: the server returned other input_ids than were sent")
        self._done.add(sample_id)
        self._next_token.pop(sample_id)
        self._n_delivered += 1
        return ExtractedSample(sample_id, ids, mask, hidden, self.aux_layer_ids, self.final_layer_id)

    def _on_sample_error(self, raw: dict[str, Any]) -> SampleFailure:
        meta = SampleErrorMeta.from_dict(raw)
        sample_id = meta.sample_id
        if sample_id not in self.expected_ids or sample_id in self._done:
            raise ProtocolError(f"SAMPLE_ERROR for {sample_id!r}, which was not requested or already done")
        self._chunks.pop(sample_id, None)
        self._next_token.pop(sample_id, None)
        self._done.add(sample_id)
        self._n_failed += 1
        return SampleFailure(sample_id, meta.error.type, meta.error.message, meta.error.retryable)
