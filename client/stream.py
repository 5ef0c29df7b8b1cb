"""Frames of one ``/v1/extract`` response -> ``ExtractedSample`` / ``SampleFailure`` (sans-IO).

Checks, in order: the HEADER describes states of a known shape in the dtype asked for (bf16, or FP8
when the request said ``"dtype": "float8_e4m3fn"``); every DATA frame names a
requested sample, decodes within its declared ``raw_bytes`` (bounded by the stream's
``max_payload_bytes``), holds exactly ``hidden_states BF16 [m, L, H]`` (FP8: ``F8_E4M3 [m, L, H]`` and
``hidden_scales F32 [m, L]``), ``input_ids I32 [m]`` and ``loss_mask U8 [m]`` for its token range,
and continues its sample where the last chunk stopped; the final chunk completes the sample at
``n_tokens``; token-id samples come back with the ids we sent;
the HEADER's model identity (``ModelIdentity``: model, revision, layers, sizes, tokenizer) equals
``/v1/info``'s when the caller knows it (``expect``);
END's counts equal what was received and every requested sample was answered.

Every meta is read through its typed wire object (``eagle3.core.protocol.wire``): malformed meta from
a buggy server (valid checksum, wrong shape) raises ``ProtocolError`` naming the field (the SDK turns it
into a non-retryable ``StreamError``), never a bare ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eagle3.client.errors import IncompatibleError, SampleFailure, StreamError
from eagle3.core.codec import decode_payload, parse_safetensors
from eagle3.core.protocol.features import DTYPE_BF16, DTYPE_FP8
from eagle3.core.protocol.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Allocate,
    Frame,
    FrameDecoder,
    FrameType,
    ProtocolError,
)
from eagle3.core.protocol.model_identity import ModelIdentity
from eagle3.core.protocol.wire import AbortMeta, DataMeta, EndMeta, SampleErrorMeta, StreamHeader
from eagle3.core.sample import ExtractedSample, NDArray

RAW_SLACK_BYTES = 1 << 20  # a chunk's safetensors header on top of max_payload_bytes of tensor data


MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError)


class StreamAssembler:
    def __init__(
        self,
        url: str,
        requests: list[dict[str, Any]],
        decoder: FrameDecoder | None = None,
        expect: ModelIdentity | None = None,
        allocate: Allocate | None = None,
        dtype: str = DTYPE_BF16,
    ) -> None:
        self.url = url
        self.dtype = dtype  # what the request asked for; the HEADER must say the same
        self.fp8 = dtype == DTYPE_FP8
        self.allocate = allocate  # n_bytes -> uint8 array for a multi-frame sample's states (None: numpy.empty)
        self.expect = expect  # the model /v1/info described, when known: every HEADER must describe the same
        self._counts = {"n_frames": 0, "n_samples": 0, "n_failed": 0, "n_tokens": 0}
        self.expected_ids = {r["id"]: r.get("input_ids") for r in requests}
        self.decoder = decoder
        self.header: StreamHeader | None = None
        self.end: EndMeta | None = None
        self.max_raw_bytes = DEFAULT_MAX_PAYLOAD_BYTES + RAW_SLACK_BYTES
        # sample id -> its (hidden, ids, mask[, scales]) arrays, allocated whole at its first chunk, filled in place
        self._filling: dict[str, tuple[NDArray, ...]] = {}
        self._next_token: dict[str, int] = {}
        self._done: set[str] = set()

    def handle(self, frame: Frame) -> list[ExtractedSample | SampleFailure]:
        self._counts["n_frames"] = frame.seq + 1
        try:
            out = self._handle(frame)
        except MALFORMED as exc:
            raise self._fail(
                f"frame {frame.seq} ({frame.type.name}): malformed meta ({type(exc).__name__}: {exc})"
            ) from None
        for item in out:
            if isinstance(item, SampleFailure):
                self._counts["n_failed"] += 1
            else:
                self._counts["n_samples"] += 1
                self._counts["n_tokens"] += item.n_tokens
        return out

    def _handle(self, frame: Frame) -> list[ExtractedSample | SampleFailure]:
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
        """END's counts must equal what this stream delivered, and every requested sample was answered."""
        got = {name: getattr(end, name) for name in self._counts}
        if got != self._counts:
            raise self._fail(f"END counts {got} differ from what was received {self._counts}")
        missing = set(self.expected_ids) - self._done
        if missing:
            raise self._fail(f"END before {len(missing)} requested sample(s), e.g. {sorted(missing)[0]!r}")
        self.end = end

    def _fail(self, message: str) -> ProtocolError:
        return ProtocolError(message)

    def _on_header(self, meta: dict[str, Any]) -> None:
        header = StreamHeader.from_dict(meta)
        self.aux_layer_ids = header.aux_layer_ids
        self.final_layer_id = header.final_layer_id
        self.hidden_size = header.hidden_size
        if header.dtype != self.dtype:
            raise self._fail(f"HEADER dtype {header.dtype!r}; this request asked for {self.dtype}")
        if header.final_norm_applied:
            raise self._fail("HEADER says final_norm_applied=true; EAGLE-3 needs the pre-norm final state")
        difference = self.expect.diff(header.identity) if self.expect is not None else ""
        if difference:
            raise IncompatibleError(
                f"{self.url}: the stream's HEADER differs from what /v1/info said ({difference}): the server changed "
                "between the two (another model behind the same URL?)"
            )
        self.max_raw_bytes = min(header.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES) + RAW_SLACK_BYTES
        if self.decoder is not None:
            self.decoder.max_payload_bytes = self.max_raw_bytes  # compressed is never larger than raw+slack
        self.header = header

    def _on_data(self, frame: Frame) -> ExtractedSample | None:
        if self.header is None:
            raise self._fail("DATA frame before HEADER")
        try:
            meta = DataMeta.from_dict(frame.meta)
        except ProtocolError as exc:
            raise self._fail(f"frame {frame.seq}: {exc}") from None
        sample_id, start, end, n_total = meta.sample_id, meta.token_start, meta.token_end, meta.n_tokens
        final, raw_bytes = meta.final, meta.raw_bytes
        if sample_id not in self.expected_ids or sample_id in self._done:
            raise self._fail(f"frame {frame.seq}: sample {sample_id!r} was not requested or came twice")
        if start != self._next_token.get(sample_id, 0) or not start < end <= n_total or final != (end == n_total):
            where = f"frame {frame.seq}: sample {sample_id!r}"
            raise self._fail(f"{where} chunk {start}:{end} of {n_total} out of order")
        if not 0 < raw_bytes <= self.max_raw_bytes:
            raise self._fail(f"frame {frame.seq}: raw_bytes {raw_bytes} over the {self.max_raw_bytes} bound")
        tensors, _ = parse_safetensors(decode_payload(frame.payload, frame.codec, raw_bytes))
        n = end - start
        n_layers = len(self.aux_layer_ids) + 1
        want = {
            "hidden_states": ("F8_E4M3" if self.fp8 else "BF16", (n, n_layers, self.hidden_size)),
            "input_ids": ("I32", (n,)),
            "loss_mask": ("U8", (n,)),
        }
        if self.fp8:
            want["hidden_scales"] = ("F32", (n, n_layers))
        for name, (dtype, shape) in want.items():
            got = tensors.get(name)
            if got is None or got.dtype != dtype or got.shape != shape:
                found = None if got is None else f"{got.dtype} {list(got.shape)}"
                raise self._fail(f"frame {frame.seq}: {name} is {found}, expected {dtype} {list(shape)}")
        parts = tuple(tensors[name].numpy() for name in want)  # states, ids, mask[, scales]
        expected = self.expected_ids[sample_id]
        if start == 0 and expected is not None and len(expected) != n_total:
            raise self._fail(f"sample {sample_id!r}: the server returned other input_ids than were sent")
        if start == 0 and n_total > self.header.n_tokens:
            raise self._fail(
                f"frame {frame.seq}: sample {sample_id!r} of {n_total} tokens, over the stream's {self.header.n_tokens}"
            )
        self._next_token[sample_id] = end
        if final and start == 0:  # the whole sample in one frame: its arrays are views of the frame, no copy
            arrays = parts
        else:
            if start == 0:  # allocated once at its full size (numpy: no zero fill), every chunk copied in place
                self._filling[sample_id] = (
                    self._states_array((n_total, n_layers, self.hidden_size)),
                    np.empty(n_total, np.int32),
                    np.empty(n_total, np.uint8),
                    *([np.empty((n_total, n_layers), np.float32)] if self.fp8 else []),
                )
            for array, part in zip(self._filling[sample_id], parts, strict=True):
                array[start:end] = part
            if not final:
                return None
            arrays = self._filling.pop(sample_id)
        hidden, ids, mask = arrays[:3]
        scales = arrays[3] if self.fp8 else None
        if expected is not None and not np.array_equal(ids, expected):
            raise self._fail(f"sample {sample_id!r}: the server returned other input_ids than were sent")
        self._done.add(sample_id)
        self._next_token.pop(sample_id)
        return ExtractedSample(sample_id, ids, mask, hidden, self.aux_layer_ids, self.final_layer_id, scales)

    def _states_array(self, shape: tuple[int, int, int]) -> NDArray:
        dtype = np.uint8 if self.fp8 else np.uint16
        if self.allocate is None:
            return np.empty(shape, dtype)
        n_bytes = shape[0] * shape[1] * shape[2] * np.dtype(dtype).itemsize
        buffer: NDArray = np.asarray(self.allocate(n_bytes))
        return buffer.view(dtype).reshape(shape)

    def _on_sample_error(self, raw: dict[str, Any]) -> SampleFailure:
        meta = SampleErrorMeta.from_dict(raw)
        sample_id = meta.sample_id
        if sample_id not in self.expected_ids or sample_id in self._done:
            raise self._fail(f"SAMPLE_ERROR for {sample_id!r}, which was not requested or already done")
        self._filling.pop(sample_id, None)
        self._next_token.pop(sample_id, None)
        self._done.add(sample_id)
        return SampleFailure(sample_id, meta.error.type, meta.error.message, meta.error.retryable)
