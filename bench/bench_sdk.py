"""Client-side frame parsing speed: ``FrameDecoder.feed`` over a realistic DATA stream (JSON).

A stream of ``--frames`` DATA frames of ``--payload-mb`` each (random bytes: the parser does not look
inside payloads) is fed in ``--chunk-kb`` pieces, as httpx hands them over. Reports MB/s of wire bytes
parsed (checksums included) on one thread; compare against the codec's decode MB/s (bench_codec.py).

    .venv/bin/python bench/bench_sdk.py            # a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core.protocol.frames import Codec, Frame, FrameDecoder, FrameType, encode_frame  # noqa: E402


def build_stream(n_frames: int, payload_bytes: int) -> bytes:
    payload = os.urandom(payload_bytes)
    frames = [encode_frame(Frame(FrameType.HEADER, 0, {"model": "bench"}))]
    for i in range(n_frames):
        meta = {"sample_id": f"s{i}", "sample_index": i, "raw_bytes": payload_bytes, "final": True}
        frames.append(encode_frame(Frame(FrameType.DATA, i + 1, meta, payload, Codec.ZSTD_SHUFFLE)))
    frames.append(encode_frame(Frame(FrameType.END, n_frames + 1, {"n_samples": n_frames})))
    return b"".join(frames)


def parse_mb_per_s(stream: bytes, chunk_bytes: int, repeats: int) -> float:
    best_s = float("inf")
    view = memoryview(stream)
    for _ in range(repeats):
        decoder = FrameDecoder()
        started = time.perf_counter()
        n_frames = 0
        for start in range(0, len(stream), chunk_bytes):
            n_frames += len(decoder.feed(view[start : start + chunk_bytes]))
        decoder.close()
        best_s = min(best_s, time.perf_counter() - started)
    return len(stream) / best_s / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--payload-mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    stream = build_stream(args.frames, int(args.payload_mb * 1e6))
    result = {
        "stream_mb": round(len(stream) / 1e6, 1),
        "parse_mb_per_s_by_chunk_kb": {
            str(kb): round(parse_mb_per_s(stream, kb << 10, args.repeats), 1) for kb in (16, 64, 1024)
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
