"""Two drafts on one code path: per-depth chain accuracy on the held-out split, past the trained depth. Prints JSON.

    python -m bench.peer_depth --data PEER_OUT/data --draft eagle3=SPEC_EXPORT --draft speculators=CKPT [--steps 7]

Both drafts run in speculators' ``Eagle3DraftModel`` (an eagle3 draft through ``eagle3 export --format
speculators``; a speculators checkpoint as saved), on the validation rows of a ``bench/peer_speculators.py``
data directory (eagle3's held-out split), packed by speculators' own loader, with ``--steps`` TTT steps. Per
position ``k``: ``full_acc_k``, the share of supervised positions whose draft chain is still all correct at
step ``k`` (speculators' metric: the expected accepted tokens at position ``k`` under greedy verification of a
teacher-forced chain), and its sum + 1 (τ at k = steps, offline). So the weights are the only difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def depth_accuracy(ckpt: Path, data: Path, steps: int, train_ratio: float) -> dict[str, Any]:
    import torch
    from speculators import SpeculatorModel
    from speculators.losses import eager
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    config = Eagle3SpeculatorConfig.from_pretrained(str(ckpt))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(str(ckpt), config=config).float().eval()
    model.load_verifier_weights()
    from eagle3.draft_trainer.ttt import load_verifier_tensors

    _target, tensors = load_verifier_tensors(str(config.speculators_config.verifier.name_or_path))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed"])  # loaded only where NaN by speculators
    dataset = ArrowDataset(
        max_len=512,
        datapath=data,
        on_missing="raise",
        train_ratio=train_ratio,
        split="val",
        hidden_states_dtype=torch.float32,
    )
    hidden = int(config.transformer_layer_config.hidden_size)
    collate = CollateFn(512, hidden, 3, dtype=torch.float32, preprocess=shift_batch)
    sums = torch.zeros(steps)
    total = 0.0
    batch_items: list[Any] = []
    used = 0
    batches = []
    for i in range(len(dataset)):  # packed in order, whole samples, <= 512 tokens (as its sampler would)
        n = int(dataset.approx_lengths[i])
        if batch_items and used + n > 512:
            batches.append(batch_items)
            batch_items, used = [], 0
        batch_items.append(dataset[i])
        used += n
    if batch_items:
        batches.append(batch_items)
    with torch.no_grad():
        for items in batches:
            batch = collate(items)
            batch.pop("error_records")
            _t, _loss, metrics = model(
                **batch, ttt_steps=steps, ttt_step_loss_decay=1.0, loss_config={"kl_div": (eager.kl_div_loss, 1.0)}
            )
            for k in range(steps):
                sums[k] += metrics[f"full_acc_{k}_sum"]
            total += float(metrics["full_acc_0_total"])
    acc = (sums / max(total, 1.0)).tolist()
    return {"full_acc": [round(a, 4) for a in acc], "tau_offline": round(1 + sum(acc), 4), "positions": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="bench/peer_speculators.py OUT/data")
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    split = json.loads((args.data.parent / "split.json").read_text())
    ratio = (split["train"] + 0.5) / (split["train"] + split["heldout"])
    out = {}
    for spec in args.draft:
        name, _, path = spec.partition("=")
        out[name] = depth_accuracy(Path(path), args.data, args.steps, ratio)
    print(json.dumps({"steps": args.steps, "heldout_samples": split["heldout"], "drafts": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
