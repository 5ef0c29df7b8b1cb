"""``eagle3 extract`` arguments and runner."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.sdk import API_KEY_ENV, DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S
from eagle3.core.cli_args import positive_float, positive_int
from eagle3.core.features_writer import DEFAULT_SHARD_MB
from eagle3.core.protocol.features import FEATURE_DTYPES
from eagle3.core.protocol.frames import CODEC_NAMES


def add_extract_command(sub: Any) -> None:
    p = sub.add_parser(
        "extract",
        help="stream hidden states of a prepared dataset from extraction servers into a features directory",
        description="Request the verifier's hidden states (aux layers + final pre-norm state) for every sample of "
        "a prepared dataset from one or more `eagle3 serve` servers and write them as safetensors shards. "
        "Rerunning the same command resumes: samples already in --out are skipped.",
    )
    p.add_argument("prepared", type=Path, metavar="PREPARED", help="directory written by eagle3 prepare")
    p.add_argument(
        "--server",
        required=True,
        action="append",
        metavar="URL",
        help="extraction server, e.g. http://gpu-node:8000; repeat for several (work is shared, a dead one skipped)",
    )
    p.add_argument("--out", required=True, type=Path, help="features directory (created, or resumed)")
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV})")
    p.add_argument(
        "--codec", choices=["auto", *sorted(CODEC_NAMES)], default=None, help="wire codec (default: the server's)"
    )
    p.add_argument(
        "--requests-per-server", type=positive_int, default=2, help="requests in flight per server (default 2)"
    )
    p.add_argument(
        "--request-tokens",
        type=positive_int,
        default=65536,
        help="tokens per request (default 65536, capped by the server's max_request_tokens)",
    )
    p.add_argument(
        "--feature-dtype",
        choices=sorted(FEATURE_DTYPES),
        default="bf16",
        help="bf16: the states as the verifier computed them (lossless, default); fp8: e4m3 with a scale per token "
        "and layer, on the wire and on disk, about half the bytes (docs/training.md, 'Features that fit the disk')",
    )
    p.add_argument(
        "--compress-shards",
        action="store_true",
        help="store shards compressed (lossless zstd per sample: zstd+planes for bf16, zstd for fp8); the trainer "
        "decompresses as it reads (docs/performance.md has the sizes and read rates)",
    )
    p.add_argument("--shard-mb", type=positive_float, default=DEFAULT_SHARD_MB, help="shard size target (default 256)")
    p.add_argument(
        "--max-retries", type=int, default=DEFAULT_MAX_RETRIES, help="failures in a row before a server is given up"
    )
    p.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S, help="read timeout per request")
    p.add_argument(
        "--wait-ready-s",
        type=float,
        default=None,
        help="wait up to this long for a server still loading (default: as long as the server expects its "
        "load to take, and then some; 0: do not wait)",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N prepared samples")
    p.add_argument("--verify", action="store_true", help="check the checksum of every shard already written first")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="the server computes every sample (bypasses its feature cache; for checks that must see the verifier run)",
    )
    p.set_defaults(func=run_extract)


def _terminate(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # same path as Ctrl-C: flush what arrived, leave a resumable directory


def run_extract(args: argparse.Namespace) -> int:
    config = ExtractConfig(
        codec=args.codec,
        request_tokens=args.request_tokens,
        requests_per_server=args.requests_per_server,
        shard_mb=args.shard_mb,
        max_retries=max(0, args.max_retries),
        timeout_s=args.timeout_s,
        wait_ready_s=args.wait_ready_s,
        limit=args.limit,
        verify=args.verify,
        progress=False if args.no_progress else None,
        cache="bypass" if args.no_cache else None,
        feature_dtype=FEATURE_DTYPES[args.feature_dtype],
        compress_shards=args.compress_shards,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = extract_dataset(args.prepared, args.out, args.server, args.api_key, config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    sys.stdout.write(f"extracted {args.prepared} -> {args.out}\n{summary.format_text()}\n")
    if summary.n_failed:
        sys.stderr.write(f"eagle3 extract: {summary.n_failed} samples failed (rerun to retry them)\n")
        return 1
    return 0
