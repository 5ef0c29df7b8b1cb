"""A scripted in-process extraction server for SDK unit tests (httpx.MockTransport).

It speaks the real wire: frames built with ``encode_frame``, payloads with ``encode_payload`` of
safetensors blobs from ``build_safetensors``. Hidden states are a deterministic function of the
token ids, so a test can compute what any sample must come back as (``expected_hidden``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from eagle3.core.codec import RawTensor, build_safetensors, encode_payload
from eagle3.core.protocol.frames import CONTENT_TYPE, PROTOCOL_VERSION, Codec, Frame, FrameType, encode_frame

HIDDEN = 16
AUX = (1, 2)
FINAL = 4
TOKENIZER_SHA = "ab" * 32


def expected_hidden(input_ids: list[int], n_layers: int = len(AUX) + 1, hidden: int = HIDDEN) -> np.ndarray:
    """bf16 bits uint16 [n, L, H]: a pure function of the ids (position i depends on ids[: i + 1])."""
    ids = np.asarray(input_ids, dtype=np.float32)
    prefix = np.cumsum(ids)[:, None, None]  # [n, 1, 1]
    grid = np.arange(n_layers * hidden, dtype=np.float32).reshape(1, n_layers, hidden)
    values = np.sin(prefix * 0.001 + grid * 0.37) * (1.0 + grid)  # [n, L, H]
    bits: np.ndarray = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits


def tokenize_messages(messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        toks = [ord(c) % 200 + 1 for c in str(m["content"])] + [0]
        ids += toks
        mask += [int(m["role"] == "assistant")] * len(toks)
    return ids, mask


def blob(hidden: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> bytes:
    tensors = {
        "hidden_states": RawTensor("BF16", tuple(hidden.shape), np.ascontiguousarray(hidden).data.cast("B")),
        "input_ids": RawTensor("I32", tuple(ids.shape), ids.astype(np.int32).data.cast("B")),
        "loss_mask": RawTensor("U8", tuple(mask.shape), mask.astype(np.uint8).data.cast("B")),
    }
    return b"".join(bytes(c) for c in build_safetensors(tensors))


def as_async(handle: Callable[[httpx.Request], httpx.Response]) -> Callable[[httpx.Request], Any]:
    """A sync MockTransport handler as an async one (what an ``httpx.AsyncClient`` needs)."""

    async def handle_async(request: httpx.Request) -> httpx.Response:
        await request.aread()
        resp = handle(request)

        async def body() -> Any:
            for chunk in resp.stream:  # type: ignore[union-attr]
                yield chunk

        return httpx.Response(resp.status_code, headers=resp.headers, content=body())

    return handle_async


@dataclass
class Call:
    """What one /v1/extract call should do (default: answer everything correctly)."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error_type: str = ""
    truncate_after_samples: int | None = None  # cut the stream after this many complete samples
    corrupt_frame: int | None = None  # flip a payload byte in this DATA frame (0-based)
    fail_ids: tuple[str, ...] = ()  # SAMPLE_ERROR for these
    fail_retryable: bool = False
    abort: dict[str, Any] | None = None  # send a terminal ERROR frame with this error after the samples
    refuse: bool = False  # raise ConnectError


class FakeServer:
    def __init__(
        self,
        *,
        max_payload_bytes: int = 1 << 20,
        codec: Codec = Codec.ZSTD_PLANES,
        script: list[Call] | None = None,
        on_call: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.codec = codec
        self.script = list(script or [])
        self.requests: list[dict[str, Any]] = []  # /v1/extract bodies, in call order
        self.on_call = on_call
        self.info: dict[str, Any] = {
            "protocol_version": PROTOCOL_VERSION, "model_id": "fake-llama", "revision": "r1", "backend": "fake",
            "device": "cpu",
            "dtype": "bfloat16", "num_hidden_layers": FINAL, "aux_layer_ids": list(AUX), "final_layer_id": FINAL,
            "final_norm_applied": False, "hidden_size": HIDDEN, "vocab_size": 256, "max_model_len": 4096,
            "tokenizer_sha256": TOKENIZER_SHA, "codecs": ["zstd+planes", "zstd+shuffle", "zstd", "none"],
            "default_codec": "zstd+planes",
            "limits": {"max_batch_tokens": 1024, "max_request_tokens": 100000, "max_body_bytes": 1 << 24,
                       "max_inflight_tokens": 1 << 20, "max_tenant_inflight_tokens": 1 << 20,
                       "max_payload_bytes": max_payload_bytes},
        }  # fmt: skip

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def async_transport(self) -> httpx.MockTransport:
        """The same server for an ``httpx.AsyncClient``: the same answers, the body as an async stream in
        the same chunks."""
        return httpx.MockTransport(as_async(self.handle))

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ready"})
        if request.url.path == "/v1/info":
            return httpx.Response(200, json=self.info)
        body = json.loads(request.content)
        self.requests.append(body)
        if self.on_call is not None:
            self.on_call(body)
        call = self.script.pop(0) if self.script else Call()
        if call.refuse:
            raise httpx.ConnectError("connection refused", request=request)
        if call.status != 200:
            envelope = {"error": {"type": call.error_type or "error", "message": "scripted", "code": call.status,
                                  "param": None, "reason": None}}  # fmt: skip
            return httpx.Response(call.status, json=envelope, headers=call.headers)
        data = self.frames(body["samples"], call)
        chunks = (data[i : i + 777] for i in range(0, len(data), 777))  # arbitrary chunk boundaries
        return httpx.Response(200, content=chunks, headers={"content-type": CONTENT_TYPE})

    def frames(self, samples: list[dict[str, Any]], call: Call) -> bytes:
        out = []
        seq = 0

        def put(ftype: FrameType, meta: dict[str, Any], payload: bytes = b"", codec: Codec = Codec.NONE) -> None:
            nonlocal seq
            out.append(encode_frame(Frame(ftype, seq, meta, payload, codec)))
            seq += 1

        n_layers = len(AUX) + 1
        request_tokens = sum(  # HEADER n_tokens: the request's tokens, as the server sends it
            len(tokenize_messages(s["messages"])[0]) if "messages" in s else len(s["input_ids"]) for s in samples
        )
        put(FrameType.HEADER, {"protocol": PROTOCOL_VERSION, "request_id": "r", "model_id": "fake-llama",
                               "revision": "r1",
                               "aux_layer_ids": list(AUX), "final_layer_id": FINAL, "final_norm_applied": False,
                               "dtype": "bfloat16", "hidden_size": HIDDEN, "vocab_size": 256,
                               "tokenizer_sha256": TOKENIZER_SHA, "n_samples": len(samples), "n_tokens": request_tokens,
                               "max_payload_bytes": self.max_payload_bytes})  # fmt: skip
        rows_per_chunk = max(1, self.max_payload_bytes // (n_layers * HIDDEN * 2))
        n_data = n_tokens = 0
        for index, sample in enumerate(samples):
            if call.truncate_after_samples is not None and index >= call.truncate_after_samples:
                if call.abort is not None:
                    put(FrameType.ERROR, {"error": call.abort, "completed_sample_ids": []})
                return b"".join(out)
            if sample["id"] in call.fail_ids:
                error = {"type": "invalid_sample", "message": "scripted failure", "retryable": call.fail_retryable}
                put(FrameType.SAMPLE_ERROR, {"sample_id": sample["id"], "sample_index": index, "error": error})
                continue
            if "messages" in sample:
                ids, mask = tokenize_messages(sample["messages"])
            else:
                ids, mask = sample["input_ids"], sample.get("loss_mask") or [0] * len(sample["input_ids"])
            hidden = expected_hidden(ids)
            n = len(ids)
            n_tokens += n
            for start in range(0, n, rows_per_chunk):
                end = min(n, start + rows_per_chunk)
                raw = blob(hidden[start:end], np.asarray(ids[start:end]), np.asarray(mask[start:end]))
                payload = encode_payload(raw, self.codec)
                meta = {"sample_id": sample["id"], "sample_index": index, "token_start": start, "token_end": end,
                        "n_tokens": n, "final": end == n, "raw_bytes": len(raw)}  # fmt: skip
                put(FrameType.DATA, meta, payload, self.codec)
                if call.corrupt_frame == n_data:  # the checksum was computed on the clean bytes
                    head = out[-1]
                    out[-1] = head[:-1] + bytes([head[-1] ^ 0xFF])
                n_data += 1
        if call.abort is not None:
            put(FrameType.ERROR, {"error": call.abort, "completed_sample_ids": []})
            return b"".join(out)
        n_failed = sum(s["id"] in call.fail_ids for s in samples)
        put(FrameType.END, {"n_frames": seq + 1, "n_samples": len(samples) - n_failed, "n_failed": n_failed,
                            "n_tokens": n_tokens, "payload_bytes": 0, "raw_bytes": 0})  # fmt: skip
        return b"".join(out)
