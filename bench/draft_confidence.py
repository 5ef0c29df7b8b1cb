"""Where a trained draft misses: step-0 accuracy by the verifier's confidence in the token. Prints JSON.

    python -m bench.draft_confidence --run RUN --features FEATURES --vocab VOCAB [--model SmolLM2-135M-Instruct]
        [--train-samples 60]

For the held-out split of ``--features`` (the trainer's hash split) and for the first ``--train-samples``
samples of its training split, every supervised step-0 term (the draft, given the verifier's aux states
at row t and the token at t+1, proposes the verifier's greedy token after t+1) is put in a bucket by the
verifier's top-1 probability for that token (its full-vocab softmax at row t+1). A draft that generalises
scores on held-out what it scores on trained samples in each bucket; a gap where the verifier is sure of
its token (top-1 >= 0.9) says the draft lacks data, not that the verifier's choice is a coin flip.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from eagle3.draft_trainer.train import Trainer

BUCKETS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01))


def step0_hits_by_confidence(trainer: Trainer, positions: tuple[int, ...]) -> dict[str, object]:
    """Accuracy of step 0 per bucket of the verifier's top-1 probability, over ``positions``' samples."""
    from eagle3.draft_trainer.ttt import step_valid, ttt_forward

    cfg = trainer.cfg
    top1, hits = [], []
    plan = trainer.data.plan(positions, cfg.max_batch_tokens, seed=0, epoch=0, shuffle=False, truncate=True)
    with torch.no_grad():
        for batch_positions in plan:
            batch = trainer.data.load(batch_positions, cfg.max_batch_tokens)
            result = ttt_forward(trainer.model, trainer.teacher, batch, 1)
            rows = step_valid(batch, 0).nonzero().squeeze(1)  # [m] supervised step-0 terms
            probs = trainer.teacher(batch.final[rows + 1]).float().softmax(-1)  # [m, V] the verifier at t+1
            top1.append(probs.max(-1).values)
            hits.append(result.hits[0][rows])
    p, h = torch.cat(top1), torch.cat(hits).float()
    buckets = []
    for lo, hi in BUCKETS:
        sel = (p >= lo) & (p < hi)
        buckets.append({"verifier_top1": [lo, min(hi, 1.0)], "share": round(sel.float().mean().item(), 3),
                        "step0_acc": round(h[sel].mean().item(), 3) if bool(sel.any()) else None})  # fmt: skip
    return {"samples": len(positions), "terms": len(h), "step0_acc": round(h.mean().item(), 4),
            "mean_verifier_top1": round(p.mean().item(), 3), "buckets": buckets}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--run", required=True, help="a run directory (eagle3 train --out)")
    parser.add_argument("--features", required=True)
    parser.add_argument("--vocab", required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--train-samples", type=int, default=60)
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.train import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, {"features": args.features, "vocab": args.vocab, "model": args.model, "out": out,
                                 "init_from": args.run, "max_batch_tokens": 512, "truncate": True, "progress": False,
                                 "torch_threads": args.threads, "heldout_fraction": args.heldout_fraction})  # fmt: skip
        trainer = Trainer(cfg)
        trainer.model.eval()
        split = trainer.data.split
        report = {"bench": "draft_confidence", "run": args.run, "features": args.features,
                  "heldout": step0_hits_by_confidence(trainer, split.heldout),
                  "train": step0_hits_by_confidence(trainer, split.train[: args.train_samples])}  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
