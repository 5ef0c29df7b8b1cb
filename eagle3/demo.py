"""``eagle3 demo``: the pipeline end to end on the embedded verifier and the builtin dataset.

Steps so far: prepare (builtin:chatterbot with SmolLM2's chat template) and vocab. The later
steps (serve, extract, train, export, evaluate) join here as they land.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from client.conversations import BUILTIN_CHATTERBOT
from client.prepare import PrepareConfig, prepare_dataset
from draft_trainer.cli import format_vocab_stats
from draft_trainer.vocab import make_vocab
from eagle3.cli_args import add_model_argument, positive_int
from eagle3.models import resolve_model_dir


def add_demo_command(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the pipeline end to end on the embedded verifier",
        description="Prepare the builtin chatterbot dataset with the verifier's chat "
        "template, then build a draft vocabulary.",
    )
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="work directory (default demo_out)")
    add_model_argument(p)
    p.add_argument("--draft-vocab-size", type=positive_int, default=32000, help="K (default 32000)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    print(f"[1/3] verifier: {resolve_model_dir(args.model)}")
    prepared = args.out / "prepared"
    print(f"[2/3] prepare {BUILTIN_CHATTERBOT} -> {prepared}")
    stats = prepare_dataset(BUILTIN_CHATTERBOT, prepared, model=args.model, config=PrepareConfig(overwrite=True))
    print(stats.format_text())
    vocab_dir = args.out / f"vocab-{args.draft_vocab_size}"
    print(f"[3/3] vocab -> {vocab_dir}")
    print(format_vocab_stats(make_vocab(prepared, vocab_dir, args.draft_vocab_size)))
    print(f"demo finished in {time.monotonic() - started:.1f} s; outputs under {args.out}")
    return 0
