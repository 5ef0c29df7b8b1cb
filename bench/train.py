"""Training throughput on CPU: tokens/s and the share of time in data loading vs compute. Prints JSON.

    python -m bench.train --features FEATURES --vocab VOCAB [--model smollm2] [--steps 20]
        [--max-batch-tokens 1024] [--ttt-steps 4] [--threads 1] [--autocast-bf16 false|true|both]
        [--attention auto,dense] [--keep-loss-elements 0,4194304] [--repeat 2]
    python -m bench.train --synthetic ...   # memory and speed vs micro-batch size (bench/train_scaling.py)

Runs ``--warmup`` steps unmeasured, then ``--steps`` optimizer steps of the real training loop
(``eagle3.draft_trainer.train.Trainer.train_step``: packed batch loading from the memory-mapped features,
TTT forward, backward, AdamW). Data time = reading + widening + packing the batch; compute = the rest.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--features")
    parser.add_argument("--vocab")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--autocast-bf16",
        default="false",
        help="bf16 autocast on CPU: false, true, or both (side by side, alternating)",
    )
    parser.add_argument(
        "--attention",
        default="",
        help="TTT attention implementations, comma list: auto, blockwise, flex, dense (default: auto with real "
        "features, blockwise,dense with --synthetic)",
    )
    real = parser.add_argument_group("real features: variants run side by side, alternating, --repeat times each")
    real.add_argument(
        "--keep-loss-elements",
        default="",
        help="ttt_loss.KEEP_LOSS_ELEMENTS values to compare (comma list; 0 checkpoints every loss chunk; "
        "default: the module's value)",
    )
    real.add_argument("--repeat", type=int, default=1, help="rounds over the variants")
    scaling = parser.add_argument_group("--synthetic: memory and speed vs tokens per micro-batch, random features")
    scaling.add_argument("--synthetic", action="store_true")
    scaling.add_argument("--shapes", default="smollm2,llama8b")
    scaling.add_argument("--tokens", default="2048,4096,8192,16384")
    scaling.add_argument("--device", default="cpu")
    scaling.add_argument("--dense-max-gb", type=float, default=6.0)
    scaling.add_argument(
        "--loss-chunk",
        default="",
        help="CUDA loss-chunk elements to compare (comma list; "
        "default: draft_trainer/ttt_loss.py's CUDA_LOSS_CHUNK_ELEMENTS)",
    )
    scaling.add_argument("--profile", action="store_true", help="add the top ops of one profiled step (CUDA)")
    scaling.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.synthetic:
        from bench import train_scaling

        args.attention = args.attention or "blockwise,dense"
        return train_scaling.main(args)
    if not args.features or not args.vocab:
        parser.error("--features and --vocab are required (or --synthetic)")
    modes = {"false": [False], "true": [True], "both": [False, True]}.get(args.autocast_bf16)
    if modes is None:
        parser.error(f"--autocast-bf16 must be false, true or both, got {args.autocast_bf16!r}")
    from eagle3.draft_trainer import ttt_loss

    try:
        keeps = [int(v) for v in args.keep_loss_elements.split(",")] if args.keep_loss_elements else None
    except ValueError:
        parser.error(f"--keep-loss-elements takes integers (comma list), got {args.keep_loss_elements!r}")
    keeps = keeps or [ttt_loss.KEEP_LOSS_ELEMENTS]
    attentions = (args.attention or "auto").split(",")
    variants = [(a, att, keep) for a in modes for att in attentions for keep in keeps]
    for _ in range(args.repeat):
        for autocast, attention, keep in variants:
            ttt_loss.KEEP_LOSS_ELEMENTS = keep
            print(json.dumps({**run_real(args, autocast, attention), "keep_loss_elements": keep}), flush=True)
    return 0


def run_real(args: argparse.Namespace, autocast: bool, attention: str = "auto") -> dict[str, object]:
    """``--steps`` real optimizer steps on ``--features`` after ``--warmup`` unmeasured ones."""
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.train import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, {"features": args.features, "vocab": args.vocab, "model": args.model, "out": out,
                                 "max_batch_tokens": args.max_batch_tokens, "ttt_steps": args.ttt_steps,
                                 "torch_threads": args.threads, "epochs": 1000, "progress": False,
                                 "autocast_bf16": autocast, "attention": attention})  # fmt: skip
        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step()
        records = []
        started = time.perf_counter()
        for _ in range(args.steps):
            records.append(trainer.train_step())
        wall_s = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in records)
    data_s = sum(r["data_s"] for r in records)
    step_s = sum(r["step_s"] for r in records)
    return {
        "bench": "train", "device": "cpu", "autocast_bf16": autocast, "attention": attention,
        "torch_threads": args.threads,
        "cpu": platform.machine(), "torch": torch.__version__, "steps": args.steps,
        "max_batch_tokens": args.max_batch_tokens,
        "ttt_steps": args.ttt_steps, "draft_vocab_size": trainer.model.cfg.draft_vocab_size,
        "tokens": tokens, "wall_s": round(wall_s, 2), "train_tokens_per_s": round(tokens / wall_s, 1),
        "steps_per_s": round(args.steps / wall_s, 3), "data_share": round(data_s / step_s, 4),
        "compute_share": round(1 - data_s / step_s, 4), "data_ms_per_step": round(1000 * data_s / args.steps, 1),
        "loss_last": round(records[-1]["loss"], 4),
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
