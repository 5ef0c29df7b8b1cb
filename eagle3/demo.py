"""``eagle3 demo``: the pipeline end to end on the embedded verifier and the builtin dataset.

Steps: prepare (builtin:chatterbot with the verifier's chat template), vocab, then a resident
``eagle3 serve`` subprocess and ``extract_dataset`` through HTTP to a features directory (the same
path every user takes: nothing here talks to the verifier in-process), then train, export, eval.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from client.conversations import BUILTIN_CHATTERBOT
from client.extract import ExtractConfig, ExtractSummary, extract_dataset
from client.prepare import PrepareConfig, prepare_dataset
from draft_trainer.cli import format_vocab_stats
from draft_trainer.vocab import make_vocab
from eagle3.cli_args import add_model_argument, positive_int
from eagle3.local_server import LocalServer
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
    p.add_argument("--backend", choices=("auto", "hf", "vllm"), default="hf", help="the server's backend (default hf)")
    p.set_defaults(func=run_demo)


def extract_via_server(prepared: Path, features: Path, model: str, backend: str, work_dir: Path) -> ExtractSummary:
    """Start a local server, pull the whole prepared dataset to ``features`` (resumable), stop it."""
    log_path = work_dir / "server.log"
    with LocalServer(["--model", model, "--backend", backend], log_path) as server:
        server.wait_ready(timeout_s=1800, on_phase=lambda phase: print(f"  server: {phase}"))
        print(f"  server ready at {server.url} (log {log_path})")
        return extract_dataset(prepared, features, server.url, config=ExtractConfig(progress=None))


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    print(f"[1/4] verifier: {resolve_model_dir(args.model)}")
    prepared = args.out / "prepared"
    print(f"[2/4] prepare {BUILTIN_CHATTERBOT} -> {prepared}")
    stats = prepare_dataset(BUILTIN_CHATTERBOT, prepared, model=args.model, config=PrepareConfig(overwrite=True))
    print(stats.format_text())
    vocab_dir = args.out / f"vocab-{args.draft_vocab_size}"
    print(f"[3/4] vocab -> {vocab_dir}")
    print(format_vocab_stats(make_vocab(prepared, vocab_dir, args.draft_vocab_size)))
    features = args.out / "features"
    print(f"[4/4] eagle3 serve --backend {args.backend} + extract {prepared} -> {features} over HTTP")
    print(extract_via_server(prepared, features, args.model, args.backend, args.out).format_text())
    print(f"demo finished in {time.monotonic() - started:.1f} s; outputs under {args.out}")
    return 0
