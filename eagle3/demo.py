"""``eagle3 demo``: the pipeline end to end on the embedded verifier and the builtin dataset.

Steps: prepare (builtin:chatterbot with the verifier's chat template); distill (the verifier's own
greedy replies to the first ``--samples`` prompts: a draft learns what the verifier will say, not what
the corpus said); vocab; a resident ``eagle3 serve`` subprocess and ``extract_dataset`` through HTTP
to a features directory (the path every user takes: nothing here talks to the verifier in-process for
features); train; export (vLLM's flat EAGLE-3 format); eval: real speculative decoding with the
verifier on held-out prompts (prompts never trained on), printing τ and the speedup.

Every step writes under ``--out``; a rerun redoes prepare/vocab (cheap) and resumes extraction.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from eagle3.client.extract import ExtractConfig, ExtractSummary, extract_dataset
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.core.cli_args import add_model_argument, positive_int
from eagle3.core.conversations import BUILTIN_CHATTERBOT
from eagle3.core.models import resolve_model_dir
from eagle3.draft_trainer.cli import format_vocab_stats
from eagle3.draft_trainer.vocab import make_vocab
from eagle3.local_server import LocalServer

N_STEPS = 8
# Training settings measured on this project's 2-core CPU machine (docs/training.md, "measured acceptance").
DEMO_TRAIN = {"ttt_steps": 4, "max_batch_tokens": 512, "lr": 2e-3, "torch_threads": 2}


def add_demo_command(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the pipeline end to end on the embedded verifier",
        description="prepare -> distill -> vocab -> serve + extract over HTTP -> train -> export -> eval "
        "(speculative decoding on held-out prompts: prints tau and the speedup).",
    )
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="work directory (default demo_out)")
    add_model_argument(p)
    p.add_argument("--samples", type=positive_int, default=640, help="prompts distilled and trained on (default 640)")
    p.add_argument("--epochs", type=positive_int, default=8, help="training epochs (default 8)")
    p.add_argument("--draft-vocab-size", type=positive_int, default=8192, help="K (default 8192)")
    p.add_argument("-k", type=positive_int, default=4, help="draft tokens per round in eval (default 4)")
    p.add_argument("--eval-prompts", type=positive_int, default=10, help="held-out prompts in eval (default 10)")
    p.add_argument("--backend", choices=("auto", "hf", "vllm"), default="hf", help="the server's backend (default hf)")
    p.set_defaults(func=run_demo)


def extract_via_server(prepared: Path, features: Path, model: str, backend: str, work_dir: Path) -> ExtractSummary:
    """Start a local server, pull the whole prepared dataset to ``features`` (resumable), stop it."""
    log_path = work_dir / "server.log"
    with LocalServer(["--model", model, "--backend", backend], log_path) as server:
        server.wait_ready(timeout_s=1800, on_phase=lambda phase: print(f"  server: {phase}"))
        print(f"  server ready at {server.url} (log {log_path})")
        return extract_dataset(prepared, features, server.url, config=ExtractConfig(progress=None))


def step(n: int, text: str) -> None:
    print(f"[{n}/{N_STEPS}] {text}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.distill import regenerate
    from eagle3.draft_trainer.evaluate import evaluate
    from eagle3.draft_trainer.export import check_export, export_draft
    from eagle3.draft_trainer.train import train

    started = time.monotonic()
    out: Path = args.out
    model_dir = resolve_model_dir(args.model)
    step(1, f"verifier: {model_dir}")
    prepared = out / "prepared"
    step(2, f"prepare {BUILTIN_CHATTERBOT} -> {prepared}")
    stats = prepare_dataset(BUILTIN_CHATTERBOT, prepared, model=args.model, config=PrepareConfig(overwrite=True))
    print(stats.format_text())
    distilled = out / "distilled"
    step(3, f"distill: the verifier's greedy replies to {args.samples} prompts -> {distilled}")
    t0 = time.monotonic()
    regenerate(prepared, distilled, model_dir, max_samples=args.samples)
    print(f"  {time.monotonic() - t0:.0f} s")
    vocab_dir = out / f"vocab-{args.draft_vocab_size}"
    step(4, f"vocab -> {vocab_dir}")
    print(format_vocab_stats(make_vocab(distilled, vocab_dir, args.draft_vocab_size)))
    features = out / "features"
    step(5, f"eagle3 serve --backend {args.backend} + extract {distilled} -> {features} over HTTP")
    print(extract_via_server(distilled, features, args.model, args.backend, out).format_text())
    run_dir = out / "run"
    step(6, f"train -> {run_dir}")
    overrides = {"features": str(features), "vocab": str(vocab_dir), "model": args.model, "out": str(run_dir),
                 "epochs": args.epochs, **DEMO_TRAIN}  # fmt: skip
    result = train(load_config(None, overrides))
    accs = "  ".join(f"{100 * a:.1f}%" for a in result.heldout.get("heldout_acc", []))
    print(f"  {result.steps} steps in {result.train_s:.0f} s; held-out accuracy per draft step {accs}")
    export_dir = out / "export"
    step(7, f"export (vLLM eagle3 format) -> {export_dir}")
    export_draft(run_dir, export_dir)
    print(f"  {len(check_export(export_dir))} tensors match vLLM's loader")
    step(8, f"eval: speculative decoding, k={args.k}, {args.eval_prompts} held-out prompts")
    report = evaluate(export_dir, prepared=prepared, features=features, model=args.model, k=args.k,
                      n_prompts=args.eval_prompts, threads=2)  # fmt: skip
    print(report.format_text())
    print(f"demo finished in {time.monotonic() - started:.0f} s; outputs under {out}")
    return 0 if report.identical else 1
