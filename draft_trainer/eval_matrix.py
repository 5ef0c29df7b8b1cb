"""``eagle3 eval`` over prompt sets x draft lengths: τ where the field measures it, beside the held-out split.

Each prompt set is chosen (and rendered) before any model loads: ``heldout`` (prompts of ``--prepared``
never trained on, ``evaluate.heldout_prompts``) and the built-in sets of ``core/prompt_sets.py``
(``mt-bench``: MT-Bench's 80 first turns, rendered with the verifier's chat template). Each ``k`` of
``-k 3,5,7`` is one report: the vLLM engine runs the baseline once per set and one speculative engine per
``k`` (k is fixed per engine; τ from vLLM's own counters, ``evaluate_vllm``); the eagle3 engine runs
``evaluate`` per set and ``k``. Offline figures (``--features``) are reported for the held-out set only:
they are that split's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from eagle3.core.models import resolve_model_dir
from eagle3.core.prompt_sets import prompt_set, render_user_prompt
from eagle3.draft_trainer.errors import DataError

HELDOUT = "heldout"


def choose_prompts(
    names: list[str], args: argparse.Namespace, model_dir: Path, trust_remote_code: bool = False
) -> list[tuple[str, list[list[int]]]]:
    """``(set name, prompt ids)`` per set, in the order given, before any model is loaded. A built-in set is
    rendered by the verifier's own tokenizer (``trust_remote_code``: a Kimi-style custom tokenizer class,
    as the engines load it with ``--engine-arg trust_remote_code=true``)."""
    from eagle3.draft_trainer.evaluate import heldout_prompts

    chosen: list[tuple[str, list[list[int]]]] = []
    tokenizer: Any = None
    for name in dict.fromkeys(names):  # a set named twice is measured once
        if name == HELDOUT:
            if args.prepared is None:
                raise DataError(
                    "the held-out prompt set needs --prepared (the dataset the draft was trained from); "
                    "or measure on a built-in set only: --prompt-set mt-bench"
                )
            chosen.append((name, heldout_prompts(args.prepared, args.features, args.n_prompts, args.heldout_fraction)))
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        chosen.append((name, [render_user_prompt(tokenizer, p.text) for p in prompt_set(name)]))
    return chosen


def run_eval_matrix(args: argparse.Namespace, model: str, engine_settings: Any = None) -> int:
    """The ``eval`` command: every (prompt set, k) measured and printed, then the τ matrix. ``engine_settings``:
    ``evaluate_vllm.EngineSettings`` for ``--engine vllm`` (the console passes the vllm backend's)."""
    ks: tuple[int, ...] = tuple(args.k)
    names = args.prompt_set or [HELDOUT]
    engine_args: dict[str, Any] = {}
    if args.engine == "vllm":  # a malformed engine argument is refused before any work
        from eagle3.core.engine_args import EngineArgsError, parse_engine_args
        from eagle3.draft_trainer.evaluate_vllm import VllmEvalError

        try:
            engine_args = parse_engine_args(args.engine_arg, args.engine_args_json)
        except EngineArgsError as exc:
            raise VllmEvalError(str(exc)) from None
    model_dir = resolve_model_dir(model)
    sets = choose_prompts(names, args, model_dir, bool(engine_args.get("trust_remote_code")))
    rows: list[tuple[str, int, dict[str, Any], float]] = []  # set, k, report as JSON, tau
    outside: dict[str, float | None] = {}  # set -> share of the verifier's tokens outside the draft vocabulary
    identical = True
    if args.engine == "vllm":
        from eagle3.draft_trainer.evaluate_vllm import evaluate_vllm_ks

        for name, prompts in sets:
            reports = evaluate_vllm_ks(
                args.export,
                model_dir,
                prompts,
                ks,
                max_new_tokens=args.max_new_tokens,
                tensor_parallel_size=args.tensor_parallel_size,
                engine_args=engine_args,
                kv_cache_gib=args.kv_cache_gib or None,
                dtype=args.dtype,
                engine_settings=engine_settings,
            )
            for report in reports:
                if not args.json:
                    print(f"[{name}]\n{report.format_text()}")
                rows.append((name, report.k, report.to_json(), report.mean_acceptance_length))
                outside[name] = report.outside_vocab_share
    else:
        from eagle3.draft_trainer.evaluate import evaluate_ks

        for name, prompts in sets:
            results = evaluate_ks(  # one baseline per prompt for every k
                args.export,
                ks,
                prepared=args.prepared,
                features=args.features if name == HELDOUT else None,
                model=model,
                n_prompts=args.n_prompts,
                max_new_tokens=args.max_new_tokens,
                threads=args.threads,
                heldout_fraction=args.heldout_fraction,
                same_sequences=args.same_sequences,
                prompts=prompts,
            )
            for result in results:
                identical &= result.identical
                if not args.json:
                    print(f"[{name}]\n{result.format_text()}")
                rows.append((name, result.k, result.to_dict(), result.tau))
                outside[name] = result.outside_vocab_share
    if args.json:
        single = len(rows) == 1  # one set, one k: the report itself, as before
        print(json.dumps(rows[0][2] if single else {"matrix": [dict(r, prompt_set=n, k=k) for n, k, r, _ in rows]}))
    elif len(rows) > 1:
        print(format_matrix(args.engine, [(n, k, tau) for n, k, _, tau in rows], ks, outside))
    return 0 if identical else 1


def format_matrix(
    engine: str,
    cells: list[tuple[str, int, float]],
    ks: tuple[int, ...],
    outside: dict[str, float | None] | None = None,
) -> str:
    """τ per prompt set (rows) and k (columns); ``outside``: per set, the share of the verifier's tokens the
    draft vocabulary lacks (the last column; blank where unknown)."""
    taus = {(name, k): tau for name, k, tau in cells}
    names = list(dict.fromkeys(name for name, _, _ in cells))
    width = max(len(n) for n in names) + 2
    known = any(share is not None for share in (outside or {}).values())
    head = " " * width + "".join(f"k={k:<7}" for k in ks) + ("outside vocab" if known else "")
    lines = [f"tau (mean tokens per verifier step, engine {engine})", head.rstrip()]
    for name in names:
        share = (outside or {}).get(name)
        tail = f"{100 * share:.1f}%" if share is not None else ""
        lines.append((f"{name:<{width}}" + "".join(f"{taus[(name, k)]:<9.3f}" for k in ks) + tail).rstrip())
    return "\n".join(lines)
