"""``eagle3 self-instruct PREPARED --server URL --out DIR`` and ``eagle3 reading-prompts DISTILLED --out DIR``:
arguments and runners (the logic is ``client/self_instruct.py`` and ``client/reading_prompts.py``)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.client.reading_prompts import ReadingConfig, passages, reading_prompts
from eagle3.client.sdk import API_KEY_ENV, SERVER_URL_ENV, ExtractionClient
from eagle3.client.self_instruct import (
    DATASET_OPENERS,
    TASK_OPENERS,
    OpenersError,
    SelfInstructConfig,
    load_openers,
    self_instruct,
    trains_as,
    write_prompt_dir,
)
from eagle3.core.cli_args import fraction_below_one, positive_float, positive_int, probability_mass


def add_self_instruct_command(sub: Any) -> None:
    p = sub.add_parser(
        "self-instruct",
        help="new user prompts written by the verifier, through a server (for eagle3 distill)",
        description="Ask a running `eagle3 serve` (POST /v1/generate) to write user turns (Magpie-style: the "
        "verifier continues the chat template's user-turn prefix), each started with the first word of a "
        "training-split prompt of PREPARED, and write them as a prepared directory for `eagle3 distill`. None "
        "equals a prompt of PREPARED; ids the trainer's held-out hash would take are skipped, so every answer "
        "trains and PREPARED's held-out split stays what eval measures.",
    )
    p.add_argument(
        "prepared",
        type=Path,
        metavar="PREPARED",
        help="the dataset whose prompts steer and are excluded: the directory you train on (its ids "
        "decide the held-out split; eagle3 distill output if you train on distilled replies)",
    )
    p.add_argument(
        "--server",
        default=os.environ.get(SERVER_URL_ENV),
        metavar="URL",
        help=f"the server, e.g. http://gpu-node:8000 (default: ${SERVER_URL_ENV})",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="prepared directory of the prompts (a rerun with the same server, data and settings reuses it; "
        "otherwise it is replaced)",
    )
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV})")
    p.add_argument("--prompts", type=positive_int, default=800, metavar="N", help="prompts to keep (default 800)")
    p.add_argument("--no-steer", action="store_true", help="no openers: the verifier writes whole turns")
    p.add_argument(
        "--openers",
        default=DATASET_OPENERS,
        metavar="dataset|task|FILE",
        help="what starts each prompt: the first words of PREPARED's training prompts (dataset, the default), "
        f"general instruction openers (task: {', '.join(TASK_OPENERS[:4])}, ...), or a file with one per line",
    )
    p.add_argument(
        "--id-prefix",
        type=id_prefix,
        default="si",
        help="sample ids <prefix>-00000...: another prefix for a second set of prompts for the same data (default si)",
    )
    add_heldout_fraction(p, "openers")
    p.add_argument("--max-tokens", type=positive_int, default=24, help="longest kept turn, tokens (default 24)")
    p.add_argument(
        "--prompts-per-request",
        type=positive_int,
        default=SelfInstructConfig.prompts_per_request,
        help=f"sequences sampled per generate request (default {SelfInstructConfig.prompts_per_request})",
    )
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default 1)")
    p.add_argument("--top-p", type=probability_mass, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="base seed: the same seed, server and data repeat (default 0)")
    p.set_defaults(func=run_self_instruct)


def add_heldout_fraction(p: Any, what: str) -> None:
    """``--heldout-fraction``: the trainer's, so ``what`` is taken from its train split only."""
    p.add_argument(
        "--heldout-fraction",
        type=fraction_below_one,
        default=0.05,
        help=f"the trainer's heldout_fraction (default 0.05): {what} come from its train split",
    )


def id_prefix(text: str) -> str:
    """``--id-prefix``: letters, digits, ``_`` (ids stay plain words: no ``~``, which marks extra replies)."""
    if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: 1-32 letters, digits or _")
    return text


def run_self_instruct(args: argparse.Namespace) -> int:
    if not args.server:
        sys.stderr.write(f"eagle3 self-instruct: error: --server URL is required (or set ${SERVER_URL_ENV})\n")
        return 2
    try:
        openers = load_openers(args.openers)
    except OpenersError as e:
        sys.stderr.write(f"eagle3 self-instruct: error: {e}\n")
        return 2
    config = SelfInstructConfig(
        n_prompts=args.prompts,
        prompts_per_request=args.prompts_per_request,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        min_tokens=min(4, args.max_tokens),
    )
    started = time.monotonic()
    with ExtractionClient(args.server, args.api_key) as client:
        result = self_instruct(
            client,
            args.prepared,
            args.out,
            config,
            args.heldout_fraction,
            steer=not args.no_steer,
            openers=openers,
            id_prefix=args.id_prefix,
        )
    steer = f"steered by {result.n_openers} openers" if result.n_openers else "unsteered"
    if result.reused:
        steer += ", reused: written by a previous run with the same server, data and settings"
    sys.stdout.write(
        f"{len(result.texts)} prompts ({steer}) in {time.monotonic() - started:.0f} s -> {args.out}\n"
        f"next: eagle3 distill {args.out} --server {args.server} --out <dir>\n"
    )
    return 0 if result.texts else 1


def add_reading_prompts_command(sub: Any) -> None:
    p = sub.add_parser(
        "reading-prompts",
        help="prompts that hand the verifier a passage (its own earlier replies) to summarise, rewrite... "
        "(for eagle3 distill)",
        description="Pair an instruction (summarise, list the points, rewrite, title, explain, continue) with a "
        "passage cut from a training-split reply of DISTILLED, and write the prompts as a prepared directory "
        "for `eagle3 distill`: data in which the verifier's reply reuses the words of its prompt, which "
        "self-instruct's short prompts never give. No server: distill is the one verifier call. Held-out "
        "replies lend no passage, and ids the trainer's held-out hash would take are skipped.",
    )
    p.add_argument(
        "prepared",
        type=Path,
        metavar="DISTILLED",
        help="a distilled dataset (eagle3 distill output): its training-split replies are the passages",
    )
    p.add_argument("--out", required=True, type=Path, help="prepared directory of the prompts (replaced)")
    p.add_argument("--prompts", type=positive_int, default=1000, metavar="N", help="prompts to keep (default 1000)")
    p.add_argument("--min-passage-tokens", type=positive_int, default=40, help="shortest passage, tokens (default 40)")
    p.add_argument(
        "--max-passage-tokens",
        type=positive_int,
        default=160,
        help="longest passage, tokens: a longer reply is cut at its last sentence end within it (default 160)",
    )
    p.add_argument("--id-prefix", type=id_prefix, default="rd", help="sample ids <prefix>-00000... (default rd)")
    add_heldout_fraction(p, "passages")
    p.add_argument("--seed", type=int, default=0, help="which passage gets which instruction (default 0)")
    p.set_defaults(func=run_reading_prompts)


def run_reading_prompts(args: argparse.Namespace) -> int:
    from eagle3.client.chat_turns import user_turn_markers
    from eagle3.client.distill import ID_SUFFIX
    from eagle3.client.prepare import load_tokenizer
    from eagle3.core.protocol.prepared import read_meta

    try:
        config = ReadingConfig(args.prompts, args.min_passage_tokens, args.max_passage_tokens, args.seed)
    except ValueError as e:
        sys.stderr.write(f"eagle3 reading-prompts: error: {e}\n")
        return 2
    meta = read_meta(args.prepared)
    tokenizer = load_tokenizer(Path(meta.model_dir))
    markers = user_turn_markers(tokenizer, meta.model)
    found = passages(tokenizer, args.prepared, args.heldout_fraction, config)
    if not found:  # e.g. a self-instruct prompt directory (one placeholder token supervised): nothing to read
        sys.stderr.write(
            f"eagle3 reading-prompts: error: {args.prepared}: no training-split reply of at least "
            f"{config.min_passage_tokens} tokens ending at a sentence end; pass a distilled dataset "
            "(eagle3 distill output) or lower --min-passage-tokens\n"
        )
        return 2
    texts = reading_prompts(found, config)
    id_ok = trains_as(ID_SUFFIX, args.heldout_fraction)
    write_prompt_dir(
        texts, args.out, tokenizer, meta, id_ok=id_ok, id_prefix=args.id_prefix, markers=markers, source="reading"
    )
    sys.stdout.write(
        f"{len(texts)} reading prompts -> {args.out}\nnext: eagle3 distill {args.out} --server <url> --out <dir>\n"
    )
    return 0 if texts else 1
