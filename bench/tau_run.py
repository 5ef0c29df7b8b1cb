"""The τ run: self-distilled chatterbot data on the embedded verifier -> features -> train -> export -> eval.

    python -m bench.tau_run --work /work/cache/tau [--stage data|train|eval|all] [--set key=value ...]

Stages (each skips what is already on disk):

* data: ``regenerate`` (the verifier's own greedy answers to the first 640 distinct chatterbot prompts),
  a draft vocab from the original + distilled assistant tokens, features of the distilled samples
  written in-process with the hf backend and the SDK's FeaturesWriter (the bytes ``eagle3 extract``
  writes);
* mix: WORK/features-mix = the distilled features + the original chatterbot answers to the distilled
  training-split prompts (``tests.trainer_helpers.write_features_mix``);
* self-instruct: ``--self-instruct N`` user prompts sampled from the verifier (Magpie-style,
  ``eagle3.client.self_instruct`` through a local ``eagle3 serve``; none equal to a chatterbot prompt,
  so both eval sets stay unseen) ->
  WORK/si-prompts, their greedy answers -> WORK/si-distilled, and WORK/features-si = WORK/features-all
  (the 640 distilled chatterbot samples) + the new samples' features;
* train: ``train(load_config(None, overrides))`` into ``--run`` (default WORK/run) on ``--features``;
* eval: export ``--run`` to RUN-export, then ``evaluate`` (speculative decoding, k=4) twice, printed as
  JSON lines: on prompts of the distilled features' held-out split (``"prompts": "heldout-split"``,
  training's distribution) and on prompts absent from them (``"unseen"``, other chatterbot topics).
  Both prompt sets exclude every prompt trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.distill_inprocess import regenerate
from eagle3.core.models import resolve_model_dir
from eagle3.draft_trainer.config import load_config, parse_overrides
from eagle3.draft_trainer.vocab import build_draft_vocab, count_assistant_tokens, save_vocab

TRAIN_DEFAULTS = {"ttt_steps": 4, "max_batch_tokens": 1024, "lr": 2e-3, "epochs": 30, "warmup_steps": 20,
                  "torch_threads": 1, "checkpoint_every_steps": 100, "heldout_fraction": 0.05}  # fmt: skip


def stage_data(work: Path, draft_vocab_size: int) -> None:
    model_dir = resolve_model_dir("smollm2")
    distilled = work / "distilled"
    if not (distilled / "samples.jsonl").is_file():
        regenerate(work / "prepared", distilled, model_dir, max_samples=640, max_new_tokens=48, batch_size=64)
    vocab_dir = work / f"vocab-{draft_vocab_size}"
    if not vocab_dir.is_dir():
        counts = count_assistant_tokens(work / "prepared") + count_assistant_tokens(distilled)
        vocab, stats = build_draft_vocab(counts, draft_vocab_size, source=f"{work / 'prepared'} + {distilled}")
        save_vocab(vocab, stats, counts, vocab_dir)
    if not (work / "features" / "manifest.jsonl").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.trainer_helpers import write_features

        started = time.monotonic()
        write_features(distilled, work / "features", model_dir, dtype="float32", shard_mb=64, aux_layer_ids=None)
        print(f"features written in {time.monotonic() - started:.0f} s", flush=True)


def stage_mix(work: Path) -> None:
    if (work / "features-mix" / "manifest.jsonl").is_file():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.trainer_helpers import write_features_mix

    started = time.monotonic()
    n_extra, n_tokens = write_features_mix(
        work / "features", work / "prepared", work / "features-mix", resolve_model_dir("smollm2")
    )
    print(f"features-mix: +{n_extra} original samples ({n_tokens} tokens) in {time.monotonic() - started:.0f} s")


def torch_threads(n_threads: int) -> None:
    import torch

    torch.set_num_threads(n_threads)


def stage_self_instruct(work: Path, n_prompts: int, seed: int) -> None:
    from eagle3.client.prepare import load_tokenizer
    from eagle3.client.sdk import ExtractionClient
    from eagle3.client.self_instruct import SelfInstructConfig, openers_and_turns, sample_prompts, write_prompt_dir
    from eagle3.core.protocol.prepared import iter_prepared, read_meta
    from eagle3.local_server import LocalServer

    model_dir = resolve_model_dir("smollm2")
    prompts_dir, distilled, features = work / "si-prompts", work / "si-distilled", work / "features-si"
    if not (prompts_dir / "samples.jsonl").is_file():
        started = time.monotonic()
        tokenizer = load_tokenizer(model_dir)
        exclude = openers_and_turns(tokenizer, work / "prepared", 0.05)[1]  # every chatterbot user turn
        server_args = ["--model", str(model_dir), "--dtype", "float32"]
        with LocalServer(server_args, work / "si-server.log") as server, ExtractionClient(server.url) as client:
            server.wait_ready(timeout_s=1800)
            texts = sample_prompts(client, tokenizer, SelfInstructConfig(n_prompts=n_prompts, seed=seed), exclude)
        write_prompt_dir(texts, prompts_dir, tokenizer, read_meta(work / "prepared"))
        print(f"self-instruct: {len(texts)} prompts in {time.monotonic() - started:.0f} s", flush=True)
    if not (distilled / "samples.jsonl").is_file():
        started = time.monotonic()
        regenerate(prompts_dir, distilled, model_dir, max_samples=10**9, max_new_tokens=48, batch_size=64)
        print(f"self-instruct distilled in {time.monotonic() - started:.0f} s", flush=True)
    if not (features / "manifest.jsonl").is_file():
        import dataclasses

        from eagle3.core.features_reader import FeaturesReader
        from eagle3.core.features_writer import FeaturesWriter
        from eagle3.server.backends.base import BackendConfig
        from eagle3.server.backends.hf import HfBackend
        from tests.trainer_helpers import extract_one

        started = time.monotonic()
        src = FeaturesReader(work / "features-all")
        samples = list(iter_prepared(distilled))
        writer = FeaturesWriter.open(features, dataclasses.replace(src.meta, n_samples_total=len(src) + len(samples)),
                                     shard_mb=64)  # fmt: skip
        for copied in src:
            writer.add(copied)
        backend = HfBackend(BackendConfig(model=str(model_dir), aux_layer_ids=None, dtype="float32", device="cpu"))
        backend.load(lambda *_: None)
        for sample in samples:
            writer.add(extract_one(backend, sample))
        writer.close()
        backend.close()
        print(f"features-si: {len(src)} + {len(samples)} samples in {time.monotonic() - started:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--work", type=Path, default=Path("/work/cache/tau"))
    parser.add_argument("--stage", choices=("data", "mix", "self-instruct", "train", "eval", "all"), default="all")
    parser.add_argument("--features", type=Path, default=None, help="training features (default WORK/features)")
    parser.add_argument("--run", type=Path, default=None, help="run directory (default WORK/run)")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--self-instruct", type=int, default=1500, metavar="N", help="prompts to sample")
    parser.add_argument("--seed", type=int, default=0, help="self-instruct sampling seed")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the self-instruct answers")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    work: Path = args.work
    run: Path = args.run or work / "run"
    features: Path = args.features or work / "features"
    if args.stage in ("data", "all"):
        stage_data(work, args.draft_vocab_size)
    if args.stage == "mix":
        stage_mix(work)
    if args.stage == "self-instruct":
        torch_threads(args.threads)
        stage_self_instruct(work, args.self_instruct, args.seed)
    if args.stage in ("train", "all"):
        from eagle3.draft_trainer.train import train

        vocab = str(work / f"vocab-{args.draft_vocab_size}")
        overrides = dict(TRAIN_DEFAULTS, features=str(features), vocab=vocab, model="smollm2", out=str(run))
        overrides.update(parse_overrides(args.set))
        result = train(load_config(None, overrides))
        print(json.dumps({"steps": result.steps, "train_s": round(result.train_s, 1), **result.heldout}), flush=True)
    if args.stage in ("eval", "all"):
        from eagle3.draft_trainer.evaluate import evaluate
        from eagle3.draft_trainer.export import export_draft

        export = export_draft(run / "draft", run.with_name(run.name + "-export"))
        for name, fraction in (("heldout-split", 0.05), ("unseen", None)):
            result_eval = evaluate(export, prepared=work / "prepared", features=work / "features", model="smollm2", k=4,
                                   n_prompts=10, max_new_tokens=48, threads=1, heldout_fraction=fraction)  # fmt: skip
            print(result_eval.format_text(), flush=True)
            print(json.dumps({"prompts": name, **result_eval.to_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
