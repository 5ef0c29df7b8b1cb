"""eagle3's draft trainer against a peer's, on the same features: speculators' own Trainer (issue 32 item 1).

    python -m bench.peer_speculators --run RUN_ROOT --out OUT [--recipe speculators|eagle3-arch]
        [--optimizer adamw|muon] [--max-steps N] [--threads 2]

``RUN_ROOT`` is a finished ``eagle3 demo`` directory (``features/``, ``vocab-*/``, ``run/config.json``). The
script

1. writes the run's features as speculators data (``eagle3 convert --to speculators``, with the run's
   d2t/t2d), then orders its rows as eagle3 split them: eagle3's training samples first, its held-out
   split last (the hash split of ``heldout_fraction``), with ``--train-data-ratio`` cutting exactly there, so
   the peer trains on eagle3's training samples and validates on its held-out ones (``OUT/data``);
2. runs speculators' ``train`` entry (``speculators.train.cli.main``: its model, data loader, loss,
   optimizer, scheduler and checkpointer) with the run's knobs, and two CPU shims, nothing else:

   * ``Trainer`` moves the model and batches to ``model.to(self.local_rank)`` (``0``, i.e. ``cuda:0``)
     and autocasts on ``"cuda"`` when ``torch.accelerator.current_accelerator()`` is None
     (speculators/train/trainer.py, ``Trainer.__init__`` and ``setup_model``): ``CpuTrainer`` sets both to
     the CPU before ``setup_model``;
   * its step timer calls ``torch.accelerator.synchronize()`` on every logged step, which raises
     ``RuntimeError: Cannot access accelerator device when none is available.`` on a CPU-only torch:
     with no accelerator there is nothing to wait for, so it is made a no-op;

3. prints JSON: train wall time, peak RSS of this process, steps, the last logged metrics, and the
   checkpoint directory (speculators' ``save_pretrained`` of the last epoch, the form vLLM loads).

Knobs taken from the run's config.json (docs/draft-quality.md, "Head-to-head with speculators", lists each and
where speculators has no equivalent): epochs, lr, seed, ttt_steps, step_decay, warmup_steps, weight_decay,
max_batch_tokens (speculators' ``--total-seq-len``: its packed micro-batch, padded to that length).
``--recipe speculators`` keeps speculators' own draft defaults (norm_before_residual, norm_before_fc,
norm_output: "Eagle 3.1"; lm_head frozen at the verifier's rows); ``eagle3-arch`` turns the three norms
off, the architecture eagle3 trains.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def _order_as_eagle3_split(converted: Path, data: Path, heldout_fraction: float) -> tuple[int, int]:
    """``data``: ``converted``'s rows, eagle3's training samples first, its held-out ones last (extra
    replies to held-out prompts left out, as eagle3 leaves them out of both splits). Returns (train, held)."""
    from datasets import load_from_disk

    from eagle3.core.protocol.prepared import is_heldout, variant_of
    from eagle3.draft_trainer.interop import SIDECAR

    ids = json.loads((converted / SIDECAR).read_text())["sample_ids"]
    train = [row for row, s in enumerate(ids) if not is_heldout(s, heldout_fraction)]
    held = [row for row, s in enumerate(ids) if is_heldout(s, heldout_fraction) and variant_of(s)[1] == 0]
    order = train + held
    load_from_disk(str(converted)).select(order).save_to_disk(str(data))
    (data / "hidden_states").mkdir()
    for new, old in enumerate(order):
        os.symlink(
            converted / "hidden_states" / f"hs_{old}.safetensors", data / "hidden_states" / f"hs_{new}.safetensors"
        )
    for name in ("d2t.npy", "t2d.npy", "token_freq.pt"):
        shutil.copy(converted / name, data / name)
    return len(train), len(held)


def _install_cpu_shims() -> None:
    import speculators.train.cli as spec_cli
    import torch
    from speculators.train.trainer import Trainer

    class CpuTrainer(Trainer):
        """speculators' Trainer with the model and batches on the CPU (its default is cuda:0)."""

        def setup_model(self) -> None:
            self.local_rank = torch.device("cpu")  # type: ignore[assignment]
            self.device_type = "cpu"
            super().setup_model()

    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *_a, **_k: None
        spec_cli.Trainer = CpuTrainer  # type: ignore[attr-defined]


def speculators_argv(
    cfg: dict[str, Any], model_dir: str, data: Path, save: Path, aux: list[int], args: Any
) -> list[str]:
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", model_dir,
        "--data-path", str(data),
        "--d2t-path", str(data / "d2t.npy"),
        "--t2d-path", str(data / "t2d.npy"),
        "--target-layer-ids", *[str(a) for a in aux],
        "--total-seq-len", str(cfg["max_batch_tokens"]),
        "--train-data-ratio", str(args.train_ratio),
        "--hidden-states-dtype", "bfloat16" if args.bf16 else "float32",  # eagle3: bf16 autocast on CUDA only
        "--num-workers", "0",
        "--loss-implementation", "fused" if args.cuda else "eager",  # its fused losses are Triton kernels
        "--loss-fn", "kl_div",
        "--ttt-steps", str(cfg["ttt_steps"]),
        "--ttt-step-loss-decay", str(cfg["step_decay"]),
        "--optimizer", args.optimizer,
        "--lr", str(cfg["lr"]),
        "--weight-decay", str(cfg["weight_decay"]),
        "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", str(cfg["warmup_steps"]),
        "--epochs", str(cfg["epochs"]),
        "--seed", str(cfg["seed"]),
        "--save-path", str(save),
        "--log-freq", "1",
        "--no-resume-from-checkpoint",
        "--draft-attn-impl", args.attn,
    ]  # fmt: skip
    if args.optimizer == "muon":
        argv += ["--muon-lr", str(cfg["lr"])]
    if args.recipe == "eagle3-arch":
        argv += ["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"]
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    return argv


class _MetricTap:
    """Keeps speculators' metric records (its ``speculators.metrics`` logger) for the JSON report."""

    def __init__(self) -> None:
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []

    def attach(self) -> None:
        import logging

        tap = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                msg = record.msg
                if isinstance(msg, dict):
                    (tap.val if "val" in msg else tap.train).append(msg)

        logging.getLogger("speculators.metrics").addHandler(Handler())


def _median(values: list[float]) -> float | None:
    return round(sorted(values)[len(values) // 2], 1) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="an eagle3 demo directory (read only)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", choices=("speculators", "eagle3-arch"), default="speculators")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument(
        "--attn",
        default="",
        help="speculators --draft-attn-impl (default: its simple_flex_attention on CUDA, sdpa on CPU, where "
        "flex raises 'FlexAttention does not support backward on CPU' in torch flex_attention _validate_device)",
    )
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=0, help="override the run's epochs (smoke runs)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    args.cuda = torch.accelerator.current_accelerator() is not None
    args.bf16 = args.cuda  # as eagle3's TrainConfig: autocast_bf16_cuda true, autocast_bf16 (CPU) false
    args.attn = args.attn or ("simple_flex_attention" if args.cuda else "sdpa")
    from eagle3.core.models import resolve_model_dir
    from eagle3.core.protocol.features import FeaturesMeta  # noqa: F401  (import check)
    from eagle3.draft_trainer.interop_speculators import to_speculators

    cfg = json.loads((args.run / "run" / "config.json").read_text())
    if args.epochs:
        cfg["epochs"] = args.epochs
    features = Path(cfg["features_cache"] or cfg["features"])
    meta = json.loads((features / "features.json").read_text())
    model_dir = str(resolve_model_dir(cfg["model"]))
    converted, data = args.out / "converted", args.out / "data"
    if not (data / "state.json").is_file():
        shutil.rmtree(args.out / "converted", ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
        started = time.perf_counter()
        to_speculators(features, converted, cfg["vocab"])
        n_train, n_held = _order_as_eagle3_split(converted, data, cfg["heldout_fraction"])
        (args.out / "split.json").write_text(json.dumps({"train": n_train, "heldout": n_held}))
        convert_s = time.perf_counter() - started
    else:
        convert_s = 0.0
    split = json.loads((args.out / "split.json").read_text())
    args.train_ratio = (split["train"] + 0.5) / (split["train"] + split["heldout"])  # int(N * r) == train
    save = args.out / f"ckpt-{args.recipe}-{args.optimizer}"
    spec_argv = speculators_argv(cfg, model_dir, data, save, meta["aux_layer_ids"], args)

    _install_cpu_shims()
    import speculators.train.cli as spec_cli
    from speculators.train.config import TrainConfig

    tap = _MetricTap()
    setup_metric_logger = spec_cli.setup_metric_logger  # type: ignore[attr-defined]

    def setup_and_tap(*a: Any, **k: Any) -> None:  # its dictConfig replaces the handlers: tap after it
        setup_metric_logger(*a, **k)
        tap.attach()

    spec_cli.setup_metric_logger = setup_and_tap  # type: ignore[attr-defined]
    started = time.perf_counter()
    spec_cli.main(TrainConfig.resolve(spec_argv))
    train_s = time.perf_counter() - started
    epochs = sorted(int(p.name) for p in save.iterdir() if p.is_dir() and p.name.isdigit())
    last = tap.train[-1]["train"] if tap.train else {}
    report = {
        "trainer": "speculators 0.9.0 Trainer (CPU shims only)",
        "recipe": args.recipe,
        "optimizer": args.optimizer,
        "split": split,
        "convert_s": round(convert_s, 1),
        "train_s": round(train_s, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if args.cuda else None,
        "steps": len(tap.train),
        "steps_per_epoch": len(tap.train) // max(1, len(tap.val) or 1),
        "last_train_metrics": {k: round(v, 4) for k, v in last.items() if isinstance(v, float)},
        "step_ms_median": _median([m["profile"]["step_ms"] for m in tap.train if m.get("profile")]),
        "val": [{k: round(v, 4) for k, v in m["val"].items()} for m in tap.val],
        "checkpoint": str(save / str(epochs[-1])) if epochs else None,
        "speculators_argv": spec_argv,
        "threads": args.threads,
    }
    print(json.dumps(report, indent=1))
    (args.out / f"report-{args.recipe}-{args.optimizer}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
