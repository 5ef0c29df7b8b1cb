"""``eagle3 demo``: the pipeline end to end on the embedded verifier and the builtin dataset.

Steps: prepare (builtin:chatterbot with the verifier's chat template); a resident ``eagle3 serve``
subprocess, started once and used for both of the steps that need the verifier: distill (the
verifier's own greedy replies to the first ``--samples`` prompts through ``POST /v1/generate``,
``eagle3.client.distill``: a draft learns what the verifier will say, not what the corpus said; with
``--sampled-replies N`` also N replies sampled at T 0.8 per prompt, more of the verifier's text;
with ``--self-instruct N`` also N new user prompts written by the verifier, steered by the first words
of the training-split prompts, and its greedy replies to them: ``add_self_instruct``; ``--task-prompts N``
the same after general instruction openers) and, after vocab,
``extract_dataset`` through HTTP to a features directory (the path every user takes:
nothing here loads the verifier in-process for distillation or features, so the pipeline loads it
once); train; export (vLLM's flat EAGLE-3 format); eval: real speculative decoding with the
verifier on the prompts of the held-out split (the training distribution, never trained on), printing
τ and the speedup, and the offline τ that training computes on the same prompts' distilled answers
(the online round walk replayed on their features: the two must agree, docs/draft-quality.md).

Every step writes under ``--out``; a rerun redoes prepare/vocab (cheap) and resumes distillation,
extraction and training. A SIGTERM during training (a job scheduler's) saves the checkpoint and ends
the demo with status 143 before export and eval: a partial draft is never reported as the demo's.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from eagle3.client.distill import DistillConfig, distill_dataset
from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.prepare import PrepareConfig, prepare_dataset
from eagle3.client.sdk import ExtractionClient
from eagle3.client.self_instruct import TASK_OPENERS, SelfInstructConfig, self_instruct
from eagle3.core.cli_args import add_model_argument, non_negative_int, positive_int, positive_int_list
from eagle3.core.conversations import BUILTIN_CHATTERBOT
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
from eagle3.core.protocol.prepared import concat_prepared
from eagle3.draft_trainer.cli import format_vocab_stats
from eagle3.draft_trainer.vocab import make_vocab
from eagle3.local_server import LocalServer
from eagle3.train import train_from_servers

N_STEPS = 8
EXIT_STOPPED = 128 + signal.SIGTERM  # the status a shell gives a process ended by SIGTERM
# Training settings measured on this project's 2-core CPU machine (docs/draft-quality.md, "Measured acceptance").
# fp32: the distilled replies are the verifier's fp32 greedy output, as eval's verifier computes it; bf16
# decoding on a CPU without bf16 matmul units is several times slower than fp32 (extraction then runs the
# fp32 contract, one call per sequence on CPU).
DEMO_SERVER_DTYPE = "float32"
DISTILL_NEW_TOKENS = 48  # per reply, unless --reply-tokens
DISTILL_PROMPTS_PER_REQUEST = 64  # one generate request: the verifier decodes 64 prompts as one batch
EVAL_NEW_TOKENS = 48  # per eval prompt: the figures in docs/ were measured at it
TASK_PROMPT_MAX_TOKENS = 48  # a task-steered user turn ("Explain why ...": 21 tokens on average, measured)
SELF_INSTRUCT_MAX_TOKENS = 24  # a self-instruct user turn: chatterbot's are ~8 tokens, unsteered ones ~24
# Dense TTT attention: the same math as blockwise (equal within 1e-5, tests/unit/test_ttt_attention.py) and
# faster at 512-token micro-batches, whose [heads, 512, 512] scores are small (docs/training.md, "Speed on
# this CPU"). Training is fp32 unless --bf16 (autocast, 1.2x faster on a CPU with native bf16; make demo-full
# sets it: at 18 epochs bf16 and fp32 drafts scored alike, docs/draft-quality.md; kept fp32 where the CPU emulates
# bf16, 30-50x slower: cpu_bf16 below).
DEMO_HELDOUT_FRACTION = 0.05  # the trainer's hash split, which eval's prompts come from
DEMO_TRAIN: dict[str, object] = {
    "ttt_steps": 4,
    "max_batch_tokens": 512,
    "lr": 2e-3,
    "torch_threads": 2,
    "heldout_fraction": DEMO_HELDOUT_FRACTION,
    "attention": "dense",
    # a multi-turn sample can outgrow a micro-batch: with --reply-tokens 96 one chatterbot conversation whose
    # replies end before the cap keeps all its ~35 turns (3,343 tokens); its first 512 tokens are trained
    "truncate": True,
}
# Speculative round cost in verifier decode forwards (bench/round_cost.py; docs/performance.md "Speculative
# round cost"): a 5-token verify of the 135M verifier costs 2.2x a 1-token forward on this project's CPU (fp32,
# 1 thread, compute-bound); on one H200 (bf16, Llama-3.1-8B shape, eager transformers, context 256) 1.13x,
# and a draft step 0.056x (memory-bound: the weights are read once whatever the token count).
CPU_VERIFY5_OVER_1 = 2.2
GPU_VERIFY5_OVER_1, GPU_DRAFT_STEP = 1.13, 0.056


def speedup_note(tau: float, k: int, rounds: int, tokens: int, speculative_s: float, baseline_s: float) -> str:
    """Why the CPU speedup is what it is, and what τ buys on a GPU, from this run's own timings."""
    round_cost = (speculative_s / max(1, rounds)) / (baseline_s / max(1, tokens))  # in 1-token forwards
    gpu_cost = GPU_VERIFY5_OVER_1 + k * GPU_DRAFT_STEP
    return (
        f"  why: speedup = tau / (a round's cost in verifier forwards); on this CPU a round ({k} draft steps and "
        f"one {k + 1}-token verify) cost {round_cost:.2f} forwards of the 135M verifier in this run (compute-bound: "
        f"a 5-token verify alone costs {CPU_VERIFY5_OVER_1:.1f}x a 1-token forward), so a speedup below 1x is "
        f"expected while tau < {round_cost:.2f}; on a GPU decoding is memory-bound (one H200, Llama-3.1-8B shape: "
        f"a 5-token verify {GPU_VERIFY5_OVER_1:.2f}x a 1-token forward, a draft step {GPU_DRAFT_STEP:.3f}x), "
        f"a round costs about {gpu_cost:.2f} forwards, so tau {tau:.2f} would mean a speedup of about "
        f"{tau / gpu_cost:.2f}x there."
    )


def add_demo_command(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the pipeline end to end on the embedded verifier",
        description="prepare -> serve (one load of the verifier) -> distill and extract over HTTP, vocab between "
        "-> train -> export -> eval (speculative decoding on held-out prompts: prints tau and the speedup).",
    )
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="work directory (default demo_out)")
    add_model_argument(p, default=DEFAULT_MODEL)
    p.add_argument("--samples", type=positive_int, default=640, help="prompts distilled and trained on (default 640)")
    p.add_argument("--epochs", type=positive_int, default=8, help="training epochs (default 8)")
    p.add_argument(
        "--sampled-replies",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="besides each prompt's greedy reply, N more sampled at T 0.8 and trained on (eagle3 distill "
        "--sampled-replies; default 0; make demo-full uses 3)",
    )
    p.add_argument(
        "--self-instruct",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also N user prompts written by the verifier (steered by the first words of the training "
        "prompts; none equal to a dataset prompt, none held out) and its greedy replies (default 0)",
    )
    p.add_argument(
        "--task-prompts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also N user prompts written by the verifier after general instruction openers (Write, Explain, "
        "Compare, ...: eagle3 self-instruct --openers task) and its greedy replies: broader than the dataset's "
        "(docs/draft-quality.md, 'Broader prompts'; default 0)",
    )
    p.add_argument(
        "--reply-tokens",
        type=positive_int,
        default=DISTILL_NEW_TOKENS,
        metavar="N",
        help=f"new tokens at most in each distilled reply, chat and self-instruct alike (default "
        f"{DISTILL_NEW_TOKENS}; longer replies are more of the verifier's long-form text, at up to "
        f"N/{DISTILL_NEW_TOKENS} times the distill, extract and training cost)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train under bf16 autocast where the CPU computes bf16 natively (AVX512-BF16 or AMX: 1.2x faster than "
        "fp32); on a CPU that emulates it (AVX2 only: 30-50x slower, measured at start) the draft trains in fp32",
    )
    p.add_argument("--draft-vocab-size", type=positive_int, default=8192, help="K (default 8192)")
    p.add_argument("-k", type=positive_int, default=4, help="draft tokens per round in eval (default 4)")
    p.add_argument(
        "--eval-prompts",
        type=positive_int,
        default=40,
        help="held-out-split prompts in eval (default 40: all of them at 640 samples)",
    )
    p.add_argument(
        "--eval-new-tokens",
        type=positive_int,
        default=EVAL_NEW_TOKENS,
        metavar="N",
        help=f"new tokens per prompt in eval and in the matrix (default {EVAL_NEW_TOKENS})",
    )
    p.add_argument(
        "--eval-matrix",
        type=positive_int_list,
        default=(),
        metavar="K[,K...]",
        help="after eval, also measure tau at each k on MT-Bench's first turns and on the held-out split and print "
        "the matrix (eagle3's engine; make demo-full uses 3,5,7; eagle3 eval --engine vllm gives vLLM's own)",
    )
    p.add_argument(
        "--mt-bench-prompts",
        type=positive_int,
        default=80,
        metavar="N",
        help="MT-Bench first turns in --eval-matrix (default 80: all of them)",
    )
    p.add_argument("--backend", choices=("auto", "hf", "vllm"), default="hf", help="the server's backend (default hf)")
    p.add_argument(
        "--extract-first",
        action="store_true",
        help="extract every sample to the features directory, then train on it (the offline path); "
        "default: train from the server while it extracts, filling the same directory (hybrid)",
    )
    p.set_defaults(func=run_demo)


def add_self_instruct(
    out: Path,
    distilled: Path,
    server_url: str,
    n_prompts: int,
    reply_tokens: int = DISTILL_NEW_TOKENS,
    n_task_prompts: int = 0,
) -> Path:
    """``n_prompts`` self-instruct prompts steered by the training-split prompts' first words, and
    ``n_task_prompts`` steered by general instruction openers (``--openers task``), with the verifier's greedy
    replies, beside ``distilled`` in ``out/train-data``. The prompts come from
    ``client.self_instruct.self_instruct`` (what ``eagle3 self-instruct`` runs): none equal to a dataset
    prompt or overlapping MT-Bench, none held out, so every new sample trains and the held-out split (offline
    and online eval) stays the dataset's own."""
    sets = [
        (n_prompts, "self-instruct", None, "si", SELF_INSTRUCT_MAX_TOKENS),
        (n_task_prompts, "task-prompts", list(TASK_OPENERS), "task", TASK_PROMPT_MAX_TOKENS),
    ]
    parts: list[str | Path] = [distilled]
    for n, name, openers, id_prefix, max_tokens in sets:
        if n < 1:
            continue
        started = time.monotonic()
        # requests of 64 sequences for throughput; a few prompts take smaller ones (16 sampled for 12 wanted)
        per_request = min(SelfInstructConfig.prompts_per_request, max(16, n))
        config = SelfInstructConfig(n_prompts=n, prompts_per_request=per_request, max_tokens=max_tokens)
        prompts_dir, distilled_dir = out / name, out / f"{name}-distilled"
        with ExtractionClient(server_url) as client:
            result = self_instruct(
                client, distilled, prompts_dir, config, DEMO_HELDOUT_FRACTION, openers=openers, id_prefix=id_prefix
            )
        how = "reused from a previous run" if result.reused else f"in {time.monotonic() - started:.0f} s"
        print(
            f"  {name}: {len(result.texts)} prompts written by the verifier ({result.n_openers} openers) {how} "
            f"-> {prompts_dir}"
        )
        greedy = DistillConfig(
            max_samples=n, max_new_tokens=reply_tokens, prompts_per_request=DISTILL_PROMPTS_PER_REQUEST
        )
        print(distill_dataset(prompts_dir, distilled_dir, server_url, config=greedy).format_text())
        parts.append(distilled_dir)
    train_data = out / "train-data"
    n_samples = concat_prepared(parts, train_data)
    print(f"  {n_samples} samples to train on: {' + '.join(map(str, parts))} -> {train_data}")
    return train_data


def cpu_bf16(requested: bool) -> bool:
    """``--bf16`` on the CPU: bf16 autocast where the CPU computes bf16 natively; where it emulates it (AVX2
    only: 30-50x slower than fp32, draft_trainer/cpu_bf16.py) the demo trains in fp32 and says so. On a GPU
    the flag is moot (``autocast_bf16_cuda`` decides)."""
    import torch

    from eagle3.draft_trainer.cpu_bf16 import cpu_bf16_speed

    if not requested or torch.cuda.is_available():
        return requested
    speed = cpu_bf16_speed()
    if speed.slow:
        print(f"  --bf16: this CPU has no native bf16 ({speed.describe()}): the draft trains in fp32")
    return not speed.slow


def step(n: int, text: str) -> None:
    print(f"[{n}/{N_STEPS}] {text}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    from eagle3.draft_trainer.config import load_config
    from eagle3.draft_trainer.errors import DataError
    from eagle3.draft_trainer.evaluate import evaluate, heldout_prompts
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
    vocab_dir = out / f"vocab-{args.draft_vocab_size}"
    features = out / "features"
    log_path = out / "server.log"
    server_args = ["--model", args.model, "--backend", args.backend, "--dtype", DEMO_SERVER_DTYPE]
    with LocalServer(server_args, log_path) as server:  # the one load of the verifier
        extra = f" (+ {args.sampled_replies} sampled at T 0.8 each)" if args.sampled_replies else ""
        step(
            3,
            f"eagle3 serve --backend {args.backend}, then distill: the verifier's greedy replies to "
            f"{args.samples} prompts{extra} through POST /v1/generate -> {distilled}",
        )
        server.wait_ready(timeout_s=1800, on_phase=lambda phase: print(f"  server: {phase}"))
        print(f"  server ready at {server.url} (log {log_path})")
        distill = DistillConfig(
            max_samples=args.samples,
            max_new_tokens=args.reply_tokens,
            prompts_per_request=DISTILL_PROMPTS_PER_REQUEST,
            sampled_replies=args.sampled_replies,
        )
        print(distill_dataset(prepared, distilled, server.url, config=distill).format_text())
        train_data = distilled
        if args.self_instruct or args.task_prompts:
            train_data = add_self_instruct(
                out, distilled, server.url, args.self_instruct, args.reply_tokens, args.task_prompts
            )
        step(4, f"vocab -> {vocab_dir}")
        print(format_vocab_stats(make_vocab(train_data, vocab_dir, args.draft_vocab_size)))
        run_dir = out / "run"
        overrides = {
            "vocab": str(vocab_dir),
            "model": args.model,
            "out": str(run_dir),
            "epochs": args.epochs,
            "autocast_bf16": cpu_bf16(args.bf16),
            **DEMO_TRAIN,
        }
        if args.extract_first:
            step(5, f"extract {train_data} -> {features} over HTTP from the same server")
            print(extract_dataset(train_data, features, server.url, config=ExtractConfig(progress=None)).format_text())
            step(6, f"train on {features} -> {run_dir}")
            result = train(load_config(None, dict(overrides, features=str(features))))
        else:  # hybrid: the first epoch streams from the server and fills the features directory, later ones read it
            step(
                5,
                f"the features of {train_data} stream from the same server while the draft trains; the first "
                f"epoch writes them to {features}, later epochs read them there",
            )
            step(6, f"train -> {run_dir}")
            cfg = load_config(None, dict(overrides, prepared=str(train_data), features_cache=str(features)))
            result = train_from_servers(cfg, [server.url])
    if result.stopped_early:  # a scheduler's SIGTERM: the checkpoint is saved; a partial draft is not the demo's
        print(
            f"  stopped by SIGTERM at step {result.steps}: checkpoint saved in {run_dir}; nothing exported or "
            "evaluated. Rerun the same command to resume (prepare/vocab redone, distill and extract kept, "
            "training resumed exactly)."
        )
        return EXIT_STOPPED
    accs = "  ".join(f"{100 * a:.1f}%" for a in result.heldout.get("heldout_acc", []))
    print(
        f"  {result.steps} steps in {result.train_s:.0f} s; held-out accuracy per draft step {accs}; "
        f"offline tau {result.heldout.get('heldout_tau', 0.0):.2f} (rounds replayed on the held-out features)"
    )
    export_dir = out / "export"
    step(7, f"export (vLLM eagle3 format) -> {export_dir}")
    export_draft(run_dir, export_dir)
    print(f"  {len(check_export(export_dir))} tensors match vLLM's loader")
    step(8, f"eval: speculative decoding, k={args.k}, up to {args.eval_prompts} prompts of the held-out split")
    fraction: float | None = DEMO_HELDOUT_FRACTION
    try:
        heldout_prompts(prepared, features, args.eval_prompts, fraction)
    except DataError:  # a small --samples can leave the hash split empty
        print("  the held-out split holds no prompt: evaluating on prompts absent from the features instead")
        fraction = None
    report = evaluate(
        export_dir,
        prepared=prepared,
        features=features,
        model=args.model,
        k=args.k,
        n_prompts=args.eval_prompts,
        max_new_tokens=args.eval_new_tokens,
        threads=2,
        heldout_fraction=fraction,
    )
    print(report.format_text())
    print(
        speedup_note(
            report.tau, report.k, report.rounds, report.generated_tokens, report.speculative_s, report.baseline_s
        )
    )
    identical = report.identical
    if args.eval_matrix:
        identical &= print_eval_matrix(args, export_dir, prepared, features, fraction)
    print(f"demo finished in {time.monotonic() - started:.0f} s; outputs under {out}")
    return 0 if identical else 1


def print_eval_matrix(
    args: argparse.Namespace, export_dir: Path, prepared: Path, features: Path, fraction: float | None
) -> bool:
    """τ on MT-Bench's first turns (an outside benchmark: never trained on, ``core/prompt_sets.py``) and on the
    held-out split, at every k of ``--eval-matrix``, with eagle3's engine; True when every output equalled the
    verifier's greedy output."""
    from transformers import AutoTokenizer

    from eagle3.core.prompt_sets import MT_BENCH, prompt_set, render_user_prompt
    from eagle3.draft_trainer.eval_matrix import HELDOUT, format_matrix
    from eagle3.draft_trainer.evaluate import evaluate_ks, heldout_prompts

    ks = tuple(args.eval_matrix)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model)))
    bench = [render_user_prompt(tokenizer, p.text) for p in prompt_set(MT_BENCH)[: args.mt_bench_prompts]]
    sets = [(MT_BENCH, bench), (HELDOUT, heldout_prompts(prepared, features, args.eval_prompts, fraction))]
    k_text = ",".join(map(str, ks))
    print(f"  tau matrix: {len(bench)} MT-Bench first turns and {len(sets[1][1])} held-out prompts at k={k_text}")
    cells: list[tuple[str, int, float]] = []
    outside: dict[str, float | None] = {}  # per set: the verifier's tokens the draft vocabulary lacks
    identical = True
    for name, prompts in sets:
        # one verifier load and one greedy baseline per prompt for every k
        results = evaluate_ks(
            export_dir,
            ks,
            prepared=None,
            model=args.model,
            threads=2,
            prompts=prompts,
            max_new_tokens=args.eval_new_tokens,
        )
        for result in results:
            identical &= result.identical
            accepted = " ".join(f"{100 * a:.0f}%" for a in result.accepted_per_position)
            print(
                f"  [{name}] k={result.k}: tau {result.tau:.3f}, accepted per position {accepted}, identical "
                f"{result.identical}"
            )
            cells.append((name, result.k, result.tau))
            outside[name] = result.outside_vocab_share
    print(format_matrix("eagle3", cells, ks, outside))
    return identical
