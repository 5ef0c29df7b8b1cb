"""``eagle3 self-instruct PREPARED --server URL --out DIR``: arguments and runner (the logic is
``client/self_instruct.py``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.client import self_instruct as si
from eagle3.client.distill import ID_SUFFIX
from eagle3.client.errors import IncompatibleError
from eagle3.client.sdk import API_KEY_ENV, SERVER_URL_ENV, ExtractionClient
from eagle3.core.cli_args import positive_float, positive_int
from eagle3.core.protocol.prepared import read_meta


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
    p.add_argument("prepared", type=Path, metavar="PREPARED",
                   help="the dataset whose prompts steer and are excluded (prepare or distill output)")  # fmt: skip
    p.add_argument("--server", default=os.environ.get(SERVER_URL_ENV), metavar="URL",
                   help=f"the server, e.g. http://gpu-node:8000 (default: ${SERVER_URL_ENV})")  # fmt: skip
    p.add_argument("--out", required=True, type=Path, help="prepared directory of the prompts (replaced)")
    p.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV})")
    p.add_argument("--prompts", type=positive_int, default=800, metavar="N", help="prompts to keep (default 800)")
    p.add_argument("--no-steer", action="store_true", help="no openers: the verifier writes whole turns")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="the trainer's heldout_fraction (default 0.05): openers come from its train split")  # fmt: skip
    p.add_argument("--max-tokens", type=positive_int, default=24, help="longest kept turn, tokens (default 24)")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature (default 1)")
    p.add_argument("--top-p", type=positive_float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="base seed: the same seed, server and data repeat (default 0)")
    p.set_defaults(func=run_self_instruct)


def run_self_instruct(args: argparse.Namespace) -> int:
    from eagle3.client.prepare import load_tokenizer

    if not args.server:
        sys.stderr.write(f"eagle3 self-instruct: error: --server URL is required (or set ${SERVER_URL_ENV})\n")
        return 2
    if not 0 <= args.heldout_fraction < 1:
        fraction = args.heldout_fraction
        sys.stderr.write(f"eagle3 self-instruct: error: --heldout-fraction must be in [0, 1), got {fraction}\n")
        return 2
    config = si.SelfInstructConfig(n_prompts=args.prompts, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, min_tokens=min(4, args.max_tokens))  # fmt: skip
    meta = read_meta(args.prepared)
    tokenizer = load_tokenizer(Path(meta.model_dir))
    openers, dataset_turns = si.openers_and_turns(tokenizer, args.prepared, args.heldout_fraction)
    started = time.monotonic()
    with ExtractionClient(args.server, args.api_key) as client:
        info = client.info()
        if info.tokenizer_sha256 != meta.tokenizer_sha256:
            raise IncompatibleError(
                f"{args.prepared} was prepared for another tokenizer than {info.url} serves ({meta.model}; server: "
                f"{info.model_id}); prepare it again with the server's --model"
            )
        texts = si.sample_prompts(client, tokenizer, config, exclude=dataset_turns,
                               openers=() if args.no_steer else openers)  # fmt: skip
    si.write_prompt_dir(texts, args.out, tokenizer, meta, id_ok=si.trains_as(ID_SUFFIX, args.heldout_fraction))
    steer = "unsteered" if args.no_steer else f"steered by {len(set(openers))} openers"
    sys.stdout.write(
        f"{len(texts)} prompts ({steer}) in {time.monotonic() - started:.0f} s -> {args.out}\n"
        f"next: eagle3 distill {args.out} --server {args.server} --out <dir>\n"
    )
    return 0 if texts else 1
