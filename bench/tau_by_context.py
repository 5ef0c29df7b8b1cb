"""Where a draft's rounds fail on MT-Bench: acceptance by the round's position in the sequence. Prints JSON.

    python -m bench.tau_by_context EXPORT [EXPORT ...] [--model SmolLM2-135M-Instruct] [-k 4]
        [--max-new-tokens 64] [--prompts 80] [--edges 100,150]

The demo's training samples are short (prompt and reply: median 88 tokens, 95 % under 100 with 48-token
replies), MT-Bench's first turns are long (the rendered prompt alone: median 68 tokens, up to 402), so its
rounds run at positions no training sample reached. RoPE is relative, but the draft attends over the
whole prefix, and how far back it looks was learnt on short ones. Each round of greedy speculative decoding
(eagle3's engine, the same rounds as ``eagle3 eval``) is put in a bucket by the position of its first
drafted token (prompt length plus the tokens already generated), per export: tau per bucket is 1 + the
mean accepted drafts of its rounds. A draft that generalises over context scores alike in every bucket;
one that learnt short contexts falls with position. The verifier's greedy output is checked too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def bucket_of(position: int, edges: list[int]) -> str:
    low = 0
    for edge in edges:
        if position < edge:
            return f"{low}-{edge - 1}"
        low = edge
    return f"{low}+"


def rounds_by_position(prompt_len: int, accepted: list[int], edges: list[int]) -> list[tuple[str, int]]:
    """(bucket, accepted) per round: round r's first draft sits after the prompt and every token committed
    before it (each earlier round commits its accepted drafts plus the verifier's own token; the verifier's
    first token comes from the prompt's forward)."""
    position, out = prompt_len + 1, []
    for n in accepted:
        out.append((bucket_of(position, edges), n))
        position += n + 1
    return out


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.core.models import resolve_model_dir
    from eagle3.core.prompt_sets import MT_BENCH, prompt_set, render_user_prompt
    from eagle3.draft_trainer.evaluate import load_export_draft
    from eagle3.draft_trainer.speculate import VerifierTaps, greedy_generate, speculative_generate
    from eagle3.draft_trainer.ttt import load_verifier_tensors

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("exports", nargs="+", type=Path)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns (default all 80)")
    p.add_argument("--edges", default="100,150", help="bucket edges in tokens (default 100,150)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    edges = [int(e) for e in args.edges.split(",")]
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [render_user_prompt(tokenizer, q.text) for q in prompt_set(MT_BENCH)[: args.prompts]]
    target, tensors = load_verifier_tensors(model_dir)
    verifier = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    verifier.eval()
    eos = target.get("eos_token_id")
    eos_id = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None
    started = time.monotonic()
    baselines = [greedy_generate(verifier, prompt, args.max_new_tokens, eos_id).tokens for prompt in prompts]
    report: dict[str, Any] = {"bench": "tau_by_context", "k": args.k, "max_new_tokens": args.max_new_tokens,
                              "prompts": len(prompts), "edges": edges, "drafts": {}}  # fmt: skip
    for export in args.exports:
        draft = load_export_draft(export, tensors["embed"])
        taps = VerifierTaps(verifier, draft.cfg.aux_layer_ids)
        buckets: dict[str, list[int]] = {}
        identical = True
        for prompt, base in zip(prompts, baselines, strict=True):
            spec = speculative_generate(verifier, draft, taps, prompt, args.k, args.max_new_tokens, eos_id)
            identical &= spec.tokens == base
            for name, n in rounds_by_position(len(prompt), spec.accepted, edges):
                buckets.setdefault(name, []).append(n)
        every = [n for ns in buckets.values() for n in ns]
        report["drafts"][str(export)] = {
            "tau": round(1 + sum(every) / max(1, len(every)), 4),
            "rounds": len(every),
            "identical": identical,
            "by_position": {
                name: {"rounds": len(ns), "tau": round(1 + sum(ns) / len(ns), 4)}
                for name, ns in sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))
            },
        }
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
