"""``eagle3 prepare`` arguments and runner."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.core.cli_args import add_model_argument, positive_int, require_model
from eagle3.core.conversations import BUILTIN_CHATTERBOT
from eagle3.core.protocol import SAMPLES_FILE, STATS_FILE


def add_prepare_command(sub: Any) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize conversations with the verifier's chat template + loss mask",
        description="Tokenize conversations (JSONL: OpenAI messages, ShareGPT conversations or "
        "prompt/response; a datasets dataset saved to disk; or builtin:chatterbot) with the "
        "verifier's chat template. Assistant tokens get loss_mask 1.",
    )
    p.add_argument(
        "--input",
        required=True,
        nargs="+",
        help=f"one or more: .jsonl (.gz ok), .json array, .parquet, saved datasets dir, or {BUILTIN_CHATTERBOT}",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (samples.jsonl, meta.json, stats.json)")
    add_model_argument(p)
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="longest sample in tokens (default and cap: the model's context length)",
    )
    p.add_argument(
        "--overlong",
        choices=("drop", "truncate"),
        default="drop",
        help="samples over --max-length: drop them (default) or keep the first max-length tokens",
    )
    p.add_argument("--limit", type=positive_int, default=None, help="read at most this many input rows")
    p.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="fail",
        help="a malformed row: stop with its file and line (default) or skip and count it",
    )
    p.add_argument("--chat-template", type=Path, default=None, help="jinja file overriding the tokenizer's template")
    p.add_argument(
        "--workers", type=positive_int, default=1, help="tokenizing processes (default 1; try the core count)"
    )
    p.add_argument("--split", default="train", help="split of a saved DatasetDict (default train)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own tokenizer code (some MoE/multimodal checkpoints)",
    )
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    model = require_model(args.model)
    template = None
    if args.chat_template is not None:
        if not args.chat_template.is_file():
            raise FileNotFoundError(f"--chat-template {args.chat_template} does not exist")
        template = args.chat_template.read_text(encoding="utf-8")
    config = PrepareConfig(
        max_length=args.max_length,
        overlong=args.overlong,
        limit=args.limit,
        on_error=args.on_error,
        chat_template=template,
        split=args.split,
        overwrite=args.overwrite,
        workers=args.workers,
        trust_remote_code=args.trust_remote_code,
    )
    stats = prepare_dataset(args.input, args.out, model=model, config=config)
    print(f"prepared {', '.join(args.input)} -> {args.out / SAMPLES_FILE}")
    print(stats.format_text())
    print(f"stats written to {args.out / STATS_FILE}")
    return 0
