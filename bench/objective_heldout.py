"""A trained run's held-out figures per objective comparison (docs/draft-quality.md, "The objective measured").
Prints JSON.

    python -m bench.objective_heldout RUN [RUN ...] [--features FEATURES] [-k 3,4,5,7]

For each run directory (its ``config.json`` and ``checkpoint.pt``), over the held-out split of its features
(the trainer's hash split; ``--features`` when the run's own path moved): the offline greedy tau at each k
(the online round walk replayed on TTT's hits, ``draft_trainer/rounds.py``, what the trainer logs as
``heldout_tau`` at its own k; the draft is unrolled to the largest k even if it trained fewer steps), and
per step the expected acceptance alpha = sum min(p, q) and the argmax accuracy. Forward passes only.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--features", default=None, help="features directory (default: the run's own)")
    parser.add_argument("-k", default="3,4,5,7", help="draft tokens per round, comma list (default 3,4,5,7)")
    args = parser.parse_args()
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.rounds import RoundCounts, simulate_rounds
    from eagle3.draft_trainer.train import Trainer
    from eagle3.draft_trainer.ttt import ttt_forward

    torch.set_num_threads(1)
    ks = sorted({int(k) for k in args.k.split(",")})
    for run in args.runs:
        cfg = load_config(f"{run}/config.json")
        if args.features:
            cfg = replace(cfg, features=args.features, features_cache="", prepared="")
        trainer = Trainer(replace(cfg, out=run))
        if not trainer.resume():
            raise SystemExit(f"{run}: no checkpoint.pt")
        trainer.model.eval()
        rounds = {k: RoundCounts(k) for k in ks}
        stats = torch.zeros(3, ks[-1])  # expected acceptance, correct, terms
        split = trainer.data.split.heldout
        plan = trainer.data.plan(split, cfg.max_batch_tokens, seed=0, epoch=0, shuffle=False, truncate=True)
        with torch.no_grad():
            for positions in plan:
                batch = trainer.data.load(positions, cfg.max_batch_tokens)
                result = ttt_forward(trainer.model, trainer.teacher, batch, ks[-1], attention=cfg.attention)
                hits = torch.stack(result.hits)  # [K, T]
                stats += torch.stack([result.accept_sums, result.correct, result.n_terms])
                for k in ks:
                    rounds[k].merge(simulate_rounds(hits[:k], batch.loss_mask, batch.seg_start, batch.seg_end))
        terms = stats[2].clamp(min=1)
        print(
            json.dumps(
                {
                    "run": run,
                    "loss": cfg.loss,
                    "seed": cfg.seed,
                    "tau": {str(k): round(rounds[k].tau, 4) for k in ks},
                    "rounds": {str(k): rounds[k].rounds for k in ks},
                    "alpha": [round(a, 4) for a in (stats[0] / terms).tolist()],
                    "acc": [round(a, 4) for a in (stats[1] / terms).tolist()],
                }
            )
        )


if __name__ == "__main__":
    main()
