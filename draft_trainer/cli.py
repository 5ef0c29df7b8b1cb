"""``eagle3 vocab`` arguments and runner."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draft_trainer.vocab import VOCAB_FILE, VocabStats, make_vocab
from eagle3.cli_args import positive_int


def add_vocab_command(sub: Any) -> None:
    p = sub.add_parser(
        "vocab",
        help="draft vocabulary (d2t/t2d) from assistant-token frequencies",
        description="Pick the K most frequent assistant tokens of a prepared dataset as the draft "
        "vocabulary and write vLLM's d2t (offsets) and t2d (mask) tensors.",
    )
    p.add_argument("--prepared", required=True, type=Path, help="directory written by eagle3 prepare")
    p.add_argument("--draft-vocab-size", type=positive_int, default=32000, help="K (default 32000)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: PREPARED/vocab-K)")
    p.set_defaults(func=run_vocab)


def format_vocab_stats(stats: VocabStats) -> str:
    lines = [
        f"draft vocab {stats.draft_vocab_size:,} of {stats.target_vocab_size:,} target tokens",
        f"  assistant tokens  {stats.assistant_token_occurrences:,} occurrences, "
        f"{stats.distinct_assistant_tokens:,} distinct",
    ]
    if stats.padded_ids:
        lines.append(
            f"  padded            {stats.padded_ids:,} ids with frequency 0 "
            "(fewer distinct assistant tokens than the draft vocab size)"
        )
    lines.append(f"  coverage          {100 * stats.coverage:.2f}% of assistant-token occurrences")
    sizes = "  ".join(f"{k}: {100 * v:.1f}%" for k, v in stats.coverage_at.items())
    lines.append(f"  coverage by size  {sizes}")
    return "\n".join(lines)


def run_vocab(args: argparse.Namespace) -> int:
    out = args.out or args.prepared / f"vocab-{args.draft_vocab_size}"
    stats = make_vocab(args.prepared, out, args.draft_vocab_size)
    print(format_vocab_stats(stats))
    print(f"wrote {out / VOCAB_FILE}")
    return 0
