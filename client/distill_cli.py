"""``eagle3 distill --server URL``: arguments and runner (the logic is ``client/distill.py``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from eagle3.client.distill import DistillConfig, distill_dataset
from eagle3.client.sdk import API_KEY_ENV, SERVER_URL_ENV
from eagle3.core.cli_args import non_negative_float, non_negative_int, positive_float, positive_int


def add_distill_command(sub: Any) -> None:
    p = sub.add_parser(
        "distill",
        help="regenerate a prepared dataset's assistant turns with the verifier, through a server",
        description="Ask a running `eagle3 serve` (POST /v1/generate) for the verifier's own reply to every "
        "assistant turn of a prepared dataset and write a prepared dataset whose loss masks cover the new "
        "replies (ids <id>-distill). Rerunning the same command resumes: finished samples are kept, none is "
        "written twice.",
    )
    p.add_argument("prepared", type=Path, metavar="PREPARED", help="directory written by eagle3 prepare")
    p.add_argument(
        "--server",
        default=os.environ.get(SERVER_URL_ENV),
        metavar="URL",
        help=f"the server, e.g. http://gpu-node:8000 (default: ${SERVER_URL_ENV})",
    )
    p.add_argument("--out", required=True, type=Path, help="prepared directory to write (created, or resumed)")
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV})")
    p.add_argument(
        "--max-samples",
        type=positive_int,
        default=None,
        help="the first N samples with distinct prompts (default: all)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="per assistant turn (default 48)")
    p.add_argument(
        "--prompts-per-request",
        type=positive_int,
        default=16,
        help="samples per batch: their turn k goes in one request (default 16)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=positive_float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--seed", type=int, default=None, help="sampled runs: base seed (default 0)")
    p.add_argument(
        "--sampled-replies",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="besides each prompt's reply, N more sampled at --sampled-temperature (ids "
        "<id>-distill~s1..~sN; training keeps every reply to a held-out prompt out; default 0)",
    )
    p.add_argument(
        "--sampled-temperature",
        type=positive_float,
        default=0.8,
        help="temperature of the --sampled-replies (default 0.8; --top-p applies to them too)",
    )
    p.add_argument("--timeout-s", type=positive_float, default=900.0, help="read timeout per request (default 900)")
    p.add_argument("--overwrite", action="store_true", help="start again instead of resuming --out")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    if not args.server:
        sys.stderr.write(f"eagle3 distill: error: --server URL is required (or set ${SERVER_URL_ENV})\n")
        return 2

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"distill: {done}/{total} samples\n")
        sys.stderr.flush()

    config = DistillConfig(
        max_samples=args.max_samples,
        max_new_tokens=args.max_new_tokens,
        prompts_per_request=args.prompts_per_request,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        sampled_replies=args.sampled_replies,
        sampled_temperature=args.sampled_temperature,
        timeout_s=args.timeout_s,
        overwrite=args.overwrite,
        progress=None if args.no_progress else progress,
    )
    summary = distill_dataset(args.prepared, args.out, args.server, args.api_key, config)
    sys.stdout.write(f"distilled {args.prepared} -> {args.out}\n{summary.format_text()}\n")
    return 0
