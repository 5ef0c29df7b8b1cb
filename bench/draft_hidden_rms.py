"""The RMS of the hidden an eagle3 draft feeds back between its steps, per step, on a run's held-out split.
Prints JSON.

    python -m bench.draft_hidden_rms --draft RUN/draft --features FEATURES [--steps 7] [--model M]

eagle3's draft feeds its pre-norm output back as the next step's hidden and takes that un-normalised hidden
as the residual (vLLM's ``LlamaForCausalLMEagle3`` without ``norm_before_residual``/``norm_output``), so
each step adds one more residual branch to the same stream. This measures how its scale moves with the
step, inside the trained ``ttt_steps`` and past it (docs/draft-quality.md, "Head-to-head with speculators'
trainer"): teacher-forced steps (``ttt_forward``) over the held-out samples, no gradients.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, help="a run's draft/ directory")
    parser.add_argument("--features", required=True)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from eagle3.core.models import resolve_model_dir
    from eagle3.draft_trainer.checkpoint import load_draft
    from eagle3.draft_trainer.data import FeaturesData
    from eagle3.draft_trainer.ttt import Teacher, load_verifier_tensors, ttt_forward

    torch.set_num_threads(args.threads)
    draft = load_draft(args.draft).eval()
    target, tensors = load_verifier_tensors(resolve_model_dir(args.model))
    draft.embed_tokens.copy_(tensors["embed"])
    teacher = Teacher(tensors["norm"], tensors["lm_head"], float(target["rms_norm_eps"]))
    data = FeaturesData(args.features, heldout_fraction=args.heldout_fraction)
    plan = data.plan(data.split.heldout, 512, seed=0, epoch=0, shuffle=False, truncate=True)
    rms: list[list[torch.Tensor]] = [[] for _ in range(args.steps + 1)]  # entering step 1..K, then K's output
    step = draft.step
    calls = [0]

    def recording_step(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attention: Any) -> Any:
        k = calls[0]
        rms[k].append(hidden.pow(2).mean(-1).sqrt())  # [T]
        out = step(tokens, hidden, positions, attention)
        if k == args.steps - 1:
            rms[k + 1].append(out.pow(2).mean(-1).sqrt())
        calls[0] += 1
        return out

    draft.step = recording_step  # type: ignore[method-assign,assignment]
    with torch.no_grad():
        for positions in plan:
            calls[0] = 0
            ttt_forward(draft, teacher, data.load(positions), args.steps, attention="blockwise")
    rows = []
    for k, parts in enumerate(rms):
        values = torch.cat(parts)
        rows.append(
            {
                "hidden": f"entering step {k + 1}" if k < args.steps else f"output of step {args.steps}",
                "rms_median": round(float(values.median()), 2),
                "rms_p90": round(float(values.quantile(0.9)), 2),
            }
        )
    print(json.dumps({"draft": args.draft, "heldout_samples": len(data.split.heldout), "rms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
