"""Warm-up at load: synthetic requests through the path a real one takes, before ``/readyz`` says 200.

An earlier measurement saw the first extract after ready take 87 s: warming up with one 8-token
``backend.extract`` call in the load thread left the first request to pay for everything else. This
runs, in order, what a request touches after the HTTP layer:

1. ``parse_request`` + ``check_samples`` on a JSON body (pydantic validators; the chat template is
   compiled and rendered and the tokenizer runs, when the model has one);
2. the scheduler's own worker thread packs the samples into ``backend.extract`` calls, at lengths
   from 1 token up to ``min(1024, max_batch_tokens, max_model_len)`` (per-shape first calls, thread
   pools, allocator growth), alone and packed;
3. ``ExtractStream.body()`` frames the results for every codec on the encoder threads (zstd
   contexts, byte-plane shuffle, safetensors), and the frames are parsed back with ``FrameDecoder``
   and ``decode_payload`` and checked against the states, so a broken codec fails the load rather
   than the first user.

Invariants: the warm-up request is an ordinary scheduler request of tenant ``_warmup`` (budgets come
back on close like any other); every counter it moved is zeroed afterwards (``Metrics.reset``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from eagle3.core.codec import decode_payload, parse_safetensors
from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol.frames import CODEC_NAMES, Codec, FrameDecoder, FrameType
from eagle3.core.protocol.wire import DataMeta, EndMeta
from eagle3.server.codec_choice import AUTO, AUTO_COMPRESSED
from eagle3.server.units import Sample
from eagle3.server.validation import check_samples, parse_request

if TYPE_CHECKING:
    from eagle3.server.runtime import Runtime

logger = logging.getLogger(__name__)
WARMUP_TENANT = "_warmup"
WARMUP_LENGTHS = (1, 7, 64, 300, 1024)  # tokens; capped by the server's limits
WARMUP_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Warm-up: what is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
]


class WarmupError(Eagle3Error, RuntimeError):
    """The warm-up request did not come back as sent (the server must not report ready)."""


def warmup_lengths(max_len: int, max_total: int) -> list[int]:
    """Distinct sample lengths within ``max_len`` whose sum stays within ``max_total``."""
    out: list[int] = []
    for n in sorted({min(n, max_len) for n in WARMUP_LENGTHS}):
        if sum(out) + n <= max_total:
            out.append(n)
    return out or [1]


def warmup_body(lengths: list[int], vocab_size: int, with_chat: bool) -> bytes:
    samples: list[dict[str, Any]] = [
        {
            "id": f"ids-{n}",
            "input_ids": [(7 * i + n) % vocab_size for i in range(n)],
            "loss_mask": [i % 2 for i in range(n)],
        }
        for n in lengths
    ]
    if with_chat:
        samples.append({"id": "chat", "messages": WARMUP_CHAT})
    return json.dumps({"samples": samples}).encode()


def warm_up(rt: Runtime) -> dict[str, float]:
    """Run the warm-up (blocking; the runtime's load thread). Returns seconds per stage."""
    info, settings = rt.info, rt.settings
    assert info is not None
    timings: dict[str, float] = {}
    started = time.monotonic()
    limit = min(settings.max_batch_tokens, info.max_model_len)
    lengths = warmup_lengths(limit, settings.request_token_cap - 512)
    body = warmup_body(lengths, info.vocab_size, rt.chat is not None)
    samples = check_samples(
        parse_request(body),
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_tokens=settings.request_token_cap,
        chat=rt.chat,
    )
    timings["validate_s"] = time.monotonic() - started
    first = AUTO_COMPRESSED if settings.default_codec == AUTO else CODEC_NAMES[settings.default_codec]
    codecs = [first] + [c for c in Codec if c != first]
    for k, codec in enumerate(codecs):
        batch = samples if k == 0 else samples[:1]  # every length once, then each other codec on one sample
        stage_started = time.monotonic()
        asyncio.run(_one_request(rt, batch, codec))
        timings[f"request_{codec.name.lower()}_s"] = time.monotonic() - stage_started
    rt.scheduler.forget_tenant(WARMUP_TENANT)
    rt.metrics.reset()
    timings["total_s"] = time.monotonic() - started
    return timings


async def _one_request(rt: Runtime, samples: list[Sample], codec: Codec) -> None:
    info, settings = rt.info, rt.settings
    assert info is not None
    stream = rt.open_stream(f"warmup-{codec.name.lower()}", WARMUP_TENANT, samples, codec, use_cache=False)
    decoder = FrameDecoder(max_payload_bytes=settings.max_payload_bytes + (1 << 20))
    frames = []
    async for piece in stream.body():
        frames += decoder.feed(piece)
    decoder.close()
    end = frames[-1]
    if end.type != FrameType.END or EndMeta.from_dict(end.meta).n_samples != len(samples):
        raise WarmupError(f"warm-up request ({codec.name}) ended with {end.type.name} {end.meta}")
    want_shape = (info.n_layers_out, info.hidden_size)
    n_tokens = {s.sample_id: 0 for s in samples}
    for frame in frames:
        if frame.type != FrameType.DATA:
            continue
        meta = DataMeta.from_dict(frame.meta)
        tensors, _ = parse_safetensors(decode_payload(frame.payload, frame.codec, meta.raw_bytes))
        states = tensors["hidden_states"]
        if states.shape[1:] != want_shape or states.shape[0] != meta.token_end - meta.token_start:
            raise WarmupError(f"warm-up sample {meta.sample_id}: states of shape {states.shape}")
        n_tokens[meta.sample_id] += states.shape[0]
    if n_tokens != {s.sample_id: s.n_tokens for s in samples}:
        raise WarmupError(f"warm-up tokens per sample {n_tokens}, sent {[s.n_tokens for s in samples]}")
