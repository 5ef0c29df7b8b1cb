"""Wire codecs on real hidden states: bytes on the wire against raw bf16, and codec speed.

States: the embedded verifier (SmolLM2-135M-Instruct, bf16) through the hf backend on the first
prepared chatterbot samples, all four stored layers (aux 2, 15, 27 + final pre-norm), exactly what a
DATA frame carries. For each codec and zstd level: wire/raw ratio and encode/decode MB/s of raw bytes
(one thread, ``eagle3.core.codec``), beside the verifier's extraction rate in MB/s of raw states. Also the
order-0 entropy of the high and low byte planes (the floor of any byte-wise coder) and the two planes as
separate zstd frames without the codec's framing (what ``zstd+planes``, codec 3, sends plus 4 bytes).

    .venv/bin/python bench/bench_codec.py              # ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.client.prepare import PrepareConfig, prepare_dataset  # noqa: E402
from eagle3.core.codec import decode_payload, encode_payload  # noqa: E402
from eagle3.core.conversations import BUILTIN_CHATTERBOT  # noqa: E402
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.core.protocol import iter_prepared  # noqa: E402
from eagle3.core.protocol.frames import CODEC_NAMES  # noqa: E402
from eagle3.server.backends.base import BackendConfig  # noqa: E402
from eagle3.server.backends.hf import HfBackend  # noqa: E402


def entropy_bits(plane: np.ndarray[Any, Any]) -> float:
    p = np.bincount(plane.ravel(), minlength=256) / plane.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def timed(fn: Any, blobs: list[bytes]) -> tuple[list[bytes], float]:
    started = time.perf_counter()
    out = [fn(b) for b in blobs]
    return out, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model_dir(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared"
        prepare_dataset(BUILTIN_CHATTERBOT, prepared, model=DEFAULT_MODEL, config=PrepareConfig(limit=args.samples))
        samples = [s.input_ids for s in iter_prepared(prepared)]
    backend = HfBackend(BackendConfig(model=str(model_dir), dtype="bfloat16"))
    backend.load(lambda _phase, _fraction: None)
    started = time.perf_counter()
    states = backend.extract(samples)  # [n, 4, 576] each
    extract_s = time.perf_counter() - started
    backend.close()
    bits = [s.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16) for s in states]
    blobs = [b.tobytes() for b in bits]
    raw_bytes = sum(map(len, blobs))
    result: dict[str, Any] = {
        "samples": len(samples),
        "tokens": sum(map(len, samples)),
        "raw_bf16_mb": round(raw_bytes / 1e6, 2),
        "extraction_raw_mb_per_s": round(raw_bytes / extract_s / 1e6, 2),
        "codecs": {},
    }
    for name, codec in CODEC_NAMES.items():
        for level in (1, 3) if name != "none" else (0,):
            wire, enc_s = timed(lambda b, c=codec, lv=level: encode_payload(b, c, lv), blobs)
            started = time.perf_counter()
            back = [decode_payload(p, codec, len(b)) for p, b in zip(wire, blobs, strict=True)]
            dec_s = time.perf_counter() - started
            assert back == blobs, f"{name} did not round-trip"
            result["codecs"][f"{name}_L{level}"] = {
                "wire_over_raw": round(sum(map(len, wire)) / raw_bytes, 4),
                "encode_mb_per_s": round(raw_bytes / enc_s / 1e6, 1),
                "decode_mb_per_s": round(raw_bytes / dec_s / 1e6, 1),
            }
    hi = np.concatenate([(b >> 8).astype(np.uint8).ravel() for b in bits])
    lo = np.concatenate([(b & 0xFF).astype(np.uint8).ravel() for b in bits])
    h_hi, h_lo = entropy_bits(hi), entropy_bits(lo)
    result["order0_entropy_bits"] = {"high_byte": round(h_hi, 3), "low_byte": round(h_lo, 3)}
    result["order0_floor_wire_over_raw"] = round((h_hi + h_lo) / 16, 4)
    compressor = zstandard.ZstdCompressor(level=1)
    started = time.perf_counter()
    split = sum(len(compressor.compress((b >> 8).astype(np.uint8).tobytes()))
                + len(compressor.compress((b & 0xFF).astype(np.uint8).tobytes())) for b in bits)  # fmt: skip
    result["not_in_protocol_separate_plane_frames_L1"] = {
        "wire_over_raw": round(split / raw_bytes, 4),
        "encode_mb_per_s": round(raw_bytes / (time.perf_counter() - started) / 1e6, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
