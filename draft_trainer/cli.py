"""``eagle3 vocab``, ``eagle3 train``, ``eagle3 export`` and ``eagle3 eval``: arguments and runners."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from eagle3.core.cli_args import add_model_argument, non_negative_float, positive_int, positive_int_list, require_model
from eagle3.core.prompt_sets import PROMPT_SETS
from eagle3.draft_trainer.vocab import VOCAB_FILE, VocabStats, make_vocab

LOSSES = ("kl", "lk_lambda", "lk_alpha")  # config.LOSSES, named here so that --help does not import torch


def add_vocab_command(sub: Any) -> None:
    p = sub.add_parser(
        "vocab",
        help="draft vocabulary (d2t/t2d) from assistant-token frequencies",
        description="Pick the K most frequent assistant tokens of a prepared dataset as the draft "
        "vocabulary and write vLLM's d2t (offsets) and t2d (mask) tensors.",
    )
    p.add_argument("--prepared", required=True, type=Path, help="directory written by eagle3 prepare")
    p.add_argument("--draft-vocab-size", type=positive_int, default=32000, help="K (default 32000)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: PREPARED/vocab-K)")
    p.set_defaults(func=run_vocab)


def format_vocab_stats(stats: VocabStats) -> str:
    lines = [
        f"draft vocab {stats.draft_vocab_size:,} of {stats.target_vocab_size:,} target tokens",
        f"  assistant tokens  {stats.assistant_token_occurrences:,} occurrences, "
        f"{stats.distinct_assistant_tokens:,} distinct",
    ]
    if stats.padded_ids:
        lines.append(
            f"  padded            {stats.padded_ids:,} ids with frequency 0 "
            "(fewer distinct assistant tokens than the draft vocab size)"
        )
    lines.append(f"  coverage          {100 * stats.coverage:.2f}% of assistant-token occurrences")
    sizes = "  ".join(f"{k}: {100 * v:.1f}%" for k, v in stats.coverage_at.items())
    lines.append(f"  coverage by size  {sizes}")
    return "\n".join(lines)


def run_vocab(args: argparse.Namespace) -> int:
    out = args.out or args.prepared / f"vocab-{args.draft_vocab_size}"
    stats = make_vocab(args.prepared, out, args.draft_vocab_size)
    print(format_vocab_stats(stats))
    print(f"wrote {out / VOCAB_FILE}")
    return 0


def add_trainer_commands(
    sub: Any,
    make_source: Callable[[argparse.Namespace], Any] | None = None,
    vllm_engine_settings: Callable[[Path, str, dict[str, Any]], dict[str, Any]] | None = None,
) -> None:
    """``eagle3 train``, ``eagle3 export``, ``eagle3 eval``. ``make_source(args)``: the feature source of
    ``train --server`` (the console package builds it with the SDK, which this package never imports);
    ``vllm_engine_settings``: ``eval --engine vllm``'s target-family engine settings
    (``evaluate_vllm.EngineSettings``; the console passes the vllm backend's, which this package never imports)."""
    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 draft on a features directory, or streamed from extraction servers",
        description="Train the 1-layer EAGLE-3 draft with training-time test on features written by eagle3 "
        "extract (--features), or streamed from servers while it trains (--prepared and --server; with "
        "--features-cache the first epoch also fills a features directory the later ones read). Resumes "
        "RUN/checkpoint.pt when present. Under torchrun, each rank reads (or fetches) its own batches.",
    )
    p.add_argument("--features", type=Path, default=None, help="features directory (eagle3 extract)")
    stream = p.add_argument_group("streamed from extraction servers (instead of --features; docs/training.md)")
    stream.add_argument("--prepared", type=Path, default=None, help="prepared dataset (eagle3 prepare)")
    stream.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="extraction server (eagle3 serve), repeatable: the servers share the work",
    )
    stream.add_argument(
        "--features-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="hybrid: read the features DIR holds, fetch and append the rest (a restart or a "
        "later epoch fetches nothing already there)",
    )
    stream.add_argument(
        "--requests-per-server", type=positive_int, default=2, help="requests in flight per server (default 2)"
    )
    stream.add_argument(
        "--feature-dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="the states asked of the servers and kept in --features-cache: bf16 (lossless, default) or fp8 "
        "(e4m3, a scale per token and layer; about half the bytes)",
    )
    stream.add_argument(
        "--compress-shards",
        action="store_true",
        help="--features-cache: store its shards compressed (lossless zstd per sample)",
    )
    stream.add_argument(
        "--wait-ready-s",
        type=non_negative_float,
        default=None,
        help="wait up to this long for the servers still loading (default: as long as they expect their load "
        "to take, and then some, as eagle3 extract does; 0: do not wait)",
    )
    p.add_argument(
        "--vocab", type=Path, default=None, help="vocab directory or vocab.safetensors (eagle3 vocab; or the config's)"
    )
    add_model_argument(p)
    p.add_argument(
        "--out", type=Path, default=None, help="run directory (checkpoints, metrics, draft/; or the config's)"
    )
    p.add_argument("--config", type=Path, default=None, help="config file (.yaml, .json or .toml) of TrainConfig keys")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config key")
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default=None,
        help="training objective (config key loss; default kl): kl, or the LK acceptance-rate losses lk_lambda "
        "(KL blended into 1 - acceptance; keys lk_kl_scale, lk_kl_decay) or lk_alpha (-log acceptance), "
        "arXiv:2602.23881 (docs/training.md)",
    )
    p.set_defaults(func=partial(run_train, make_source=make_source))

    p = sub.add_parser(
        "export",
        help="export a trained draft in vLLM's EAGLE-3 format",
        description="Write config.json + model.safetensors that vLLM loads as LlamaForCausalLMEagle3.",
    )
    p.add_argument("run", type=Path, help="run directory (or its draft/)")
    p.add_argument("--out", required=True, type=Path, help="export directory")
    p.add_argument(
        "--format",
        choices=("vllm", "speculators"),
        default="vllm",
        help="vllm: config for --speculative-config; speculators: a directory `vllm serve DIR` runs alone",
    )
    p.add_argument("--verifier", default=None, help="speculators: the target model vllm serve loads (path or org/name)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3, help="speculators: k (default 3)")
    p.set_defaults(func=run_export)

    p = sub.add_parser(
        "convert",
        help="convert features to or from SpecForge's or speculators' offline training data",
        description="eagle3 features -> SpecForge (--to specforge; the final state gets the verifier's norm, so "
        "--model is needed) or -> vLLM speculators (--to speculators; pre-norm like eagle3, bit for bit); "
        "either -> eagle3 features (--to eagle3; the source format is recognised, or --from); an eagle3 features "
        "directory -> another format of eagle3 features (--to eagle3 --feature-dtype fp8 and/or --compress-shards). "
        "See docs/training.md, 'Other trainers' formats'.",
    )
    p.add_argument("source", type=Path, help="features directory, or a SpecForge / speculators data directory")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--to", required=True, choices=("specforge", "speculators", "eagle3"), help="target format")
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("specforge", "speculators"),
        default=None,
        help="--to eagle3: the source's format (default: speculators if it holds state.json, else specforge)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the verifier: its final norm (pre-norm features -> specforge), "
        "or the identity to record (-> eagle3 from a directory eagle3 did not write)",
    )
    p.add_argument(
        "--aux-layer-ids",
        default=None,
        metavar="A,B,C",
        help="-> eagle3 with --model: the aux layers the source holds (default 2,N//2,N-3)",
    )
    p.add_argument(
        "--hidden-states-path",
        type=Path,
        default=None,
        help="speculators -> eagle3: the hs_<row> files (default SOURCE/hidden_states)",
    )
    p.add_argument(
        "--vocab",
        type=Path,
        default=None,
        help="-> speculators / specforge: an eagle3 vocab dir, written as d2t.npy/t2d.npy (speculators) "
        "or vocab_mapping.pt (SpecForge's --vocab-mapping-path)",
    )
    p.add_argument(
        "--feature-dtype",
        choices=("bf16", "fp8"),
        default=None,
        help="eagle3 features -> eagle3: the new directory's states, bf16 or fp8 (e4m3, a scale per token and layer)",
    )
    p.add_argument(
        "--compress-shards",
        action="store_true",
        help="eagle3 features -> eagle3: store the new directory's shards compressed (lossless zstd per sample)",
    )
    p.add_argument(
        "--skip-missing",
        action="store_true",
        help="speculators -> eagle3: skip rows without an hs_<row> file (failed extractions)",
    )
    p.set_defaults(func=run_convert)

    p = sub.add_parser(
        "eval",
        help="measure acceptance (tau) and speedup of an exported draft",
        description="Speculative decoding with the verifier on prompts not used in training: tau, speedup, and "
        "a check that the output equals the verifier's greedy output. --engine vllm runs real vLLM.",
    )
    p.add_argument("export", type=Path, help="export directory (eagle3 export)")
    p.add_argument("--prepared", type=Path, default=None, help="prepared dataset the held-out prompts come from")
    p.add_argument("--features", type=Path, default=None, help="training features: their prompts are excluded")
    add_model_argument(p)
    p.add_argument(
        "-k",
        type=positive_int_list,
        default=(4,),
        metavar="K[,K...]",
        help="draft tokens per round; several (3,5,7) give one report each (default 4)",
    )
    p.add_argument(
        "--prompt-set",
        action="append",
        choices=("heldout", *PROMPT_SETS),
        default=None,
        help="prompts to measure on, repeatable: heldout (of --prepared, the default) or mt-bench "
        "(MT-Bench's 80 first turns, rendered with the verifier's chat template)",
    )
    p.add_argument("--n-prompts", type=positive_int, default=10, help="held-out prompts (default 10)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens per prompt (default 48)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=None,
        metavar="F",
        help="prompts of the features' held-out split (the hash split training used with this "
        "fraction: training's distribution, never trained on) instead of prompts absent from --features",
    )
    p.add_argument("--engine", choices=("eagle3", "vllm"), default="eagle3", help="decoder (default eagle3)")
    vllm = p.add_argument_group("--engine vllm: the engines' settings (both engines, with and without the draft)")
    vllm.add_argument("--tensor-parallel-size", type=positive_int, default=1, help="GPUs per engine (default 1)")
    vllm.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any vLLM EngineArgs field, VALUE as JSON (e.g. quantization=fp8), repeatable",
    )
    vllm.add_argument("--engine-args-json", default=None, metavar="JSON", help="a JSON object of EngineArgs fields")
    vllm.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="KV cache per engine, GiB (default 1; 0: vLLM sizes it)"
    )
    vllm.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the verifier's dtype in both engines (default float32, as the eagle3 engine: the "
        "identical-output check is exact; in bf16 a near-tie can round differently in the "
        "verify pass than in a 1-token step, docs/deploy.md)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--same-sequences",
        action="store_true",
        help="also score the eval prompts' own greedy sequences offline (features from the verifier, bf16) and "
        "online, side by side (hf engine; untimed; about doubles the eval time)",
    )
    p.set_defaults(func=partial(run_eval, engine_settings=vllm_engine_settings))


def run_train(args: argparse.Namespace, make_source: Callable[[argparse.Namespace], Any] | None = None) -> int:
    from eagle3.draft_trainer.config import data_overrides, load_config, parse_overrides
    from eagle3.draft_trainer.errors import ConfigError
    from eagle3.draft_trainer.train import train

    overrides = data_overrides(
        load_config(args.config, parse_overrides(args.set)),
        features=args.features,
        prepared=args.prepared,
        features_cache=args.features_cache,
        servers=args.server,
    )
    streamed = bool(overrides.get("prepared"))
    for flag in ("vocab", "out"):
        if getattr(args, flag) is not None:
            overrides[flag] = str(getattr(args, flag))
    if args.model is not None:
        overrides["model"] = args.model
    if args.loss is not None:
        overrides["loss"] = args.loss
    overrides.update(parse_overrides(args.set))
    cfg = load_config(args.config, overrides)
    require_model(cfg.model or None, "or the key model of --config, or --set model=...")
    if not cfg.vocab:
        raise ConfigError("no draft vocabulary: give --vocab DIR (eagle3 vocab), or the key vocab of --config")
    if not cfg.out:
        raise ConfigError(
            "no run directory: give --out DIR, or the key out of --config (a run's own config.json has it)"
        )
    if streamed and make_source is None:
        raise ConfigError("--server: this entry point cannot reach servers (run it through the eagle3 command)")
    result = train(cfg, make_source(args) if streamed and make_source is not None else None)
    state = "stopped by SIGTERM (checkpoint saved; rerun to resume)" if result.stopped_early else "finished"
    print(f"train {state} at step {result.steps} in {result.train_s:.1f} s; run {result.run_dir}")
    if result.heldout:
        accs = "  ".join(f"{100 * a:.1f}%" for a in result.heldout["heldout_acc"])
        print(f"  held-out acc per step {accs}; offline tau {result.heldout['heldout_tau']:.2f} (rounds replayed)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from eagle3.draft_trainer.export import check_export, export_draft

    out = export_draft(
        args.run,
        args.out,
        format=args.format,
        verifier=args.verifier,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    if args.format == "vllm":
        check_export(out)
    print(f"exported {args.run} -> {out} ({args.format} format; shapes match vLLM's Eagle3 loader)")
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from eagle3.core.models import resolve_model_dir
    from eagle3.draft_trainer.errors import DataError
    from eagle3.draft_trainer.interop import from_specforge, meta_from_model, to_specforge
    from eagle3.draft_trainer.interop_speculators import from_speculators, to_speculators

    if args.to == "eagle3" and (args.source / "features.json").is_file():  # eagle3 features: another format
        return convert_format(args)
    if args.feature_dtype or args.compress_shards:
        from eagle3.draft_trainer.errors import DataError

        raise DataError(
            "--feature-dtype / --compress-shards: only for an eagle3 features directory -> --to eagle3 "
            f"({args.source} has no features.json, or --to is {args.to})"
        )
    model = resolve_model_dir(args.model) if args.model else None
    skipped = 0
    if args.vocab is not None and args.to == "eagle3":
        raise DataError(
            "--vocab: only --to speculators (d2t.npy, t2d.npy) and --to specforge (vocab_mapping.pt) write a vocabulary"
        )
    if args.to == "specforge":
        n = to_specforge(args.source, args.out, model, args.vocab)
    elif args.to == "speculators":
        if model is not None:
            raise DataError("--model: speculators stores the pre-norm final state, as eagle3 does; leave it out")
        n = to_speculators(args.source, args.out, args.vocab)
    else:
        try:
            aux = [int(x) for x in args.aux_layer_ids.split(",")] if args.aux_layer_ids else None
        except ValueError:
            raise DataError(f"--aux-layer-ids {args.aux_layer_ids!r}: expected comma-separated integers") from None
        meta = meta_from_model(args.model, model, aux) if model is not None else None
        source = args.source_format or ("speculators" if (args.source / "state.json").is_file() else "specforge")
        if source == "speculators":
            n, skipped = from_speculators(
                args.source, args.out, meta, hidden_states_dir=args.hidden_states_path, skip_missing=args.skip_missing
            )
        else:
            n = from_specforge(args.source, args.out, meta)
    note = f"; {skipped} rows without hidden states skipped" if skipped else ""
    print(f"converted {n} samples {args.source} -> {args.out} ({args.to}){note}")
    return 0


def convert_format(args: argparse.Namespace) -> int:
    """``eagle3 convert FEATURES --to eagle3 [--feature-dtype fp8] [--compress-shards]``."""
    from eagle3.core.features_convert import convert_features
    from eagle3.core.protocol.features import FEATURE_DTYPES, read_features_meta
    from eagle3.draft_trainer.errors import DataError

    source = read_features_meta(args.source)
    dtype = FEATURE_DTYPES[args.feature_dtype] if args.feature_dtype else source.dtype
    if dtype == source.dtype and args.compress_shards == (source.shard_codec != "none"):
        raise DataError(f"{args.source} is {source.feature_format} already: give --feature-dtype or --compress-shards")
    n = convert_features(args.source, args.out, dtype, compress=args.compress_shards)
    written = read_features_meta(args.out)
    print(f"converted {n} samples {args.source} ({source.feature_format}) -> {args.out} ({written.feature_format})")
    return 0


def run_eval(args: argparse.Namespace, engine_settings: Any = None) -> int:
    from eagle3.draft_trainer.eval_matrix import run_eval_matrix

    return run_eval_matrix(args, require_model(args.model), engine_settings)
