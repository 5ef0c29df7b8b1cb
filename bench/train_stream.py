"""Training streamed from a server (``eagle3 train --server``): never starve the trainer, never idle the server.

    PYTHONPATH=. .venv/bin/python -m bench.train_stream            # ~4 min on this 2-core VM

Two consume-once runs of the same draft on the same data, side by side in one process (issue 33):

* ``fast_server``: ``eagle3 serve --backend synthetic`` at memory speed, faster than the trainer. What
  matters is the trainer's data-wait share per epoch (time blocked on the prefetch / epoch wall time);
  the bar is < 5 %.
* ``slow_server``: the same server throttled (``--synthetic-tokens-per-s``) to about half the trainer's
  rate measured in the first run, so the trainer now waits; what matters is the server's idle share
  per epoch (1 - forward seconds / uptime, from its ``/metrics``); the bar is < 5 %.

The verifier the trainer loads is a tiny random Llama (hidden 64, 8 layers, SmolLM2's tokenizer and
vocabulary, full draft vocabulary) and the states are synthetic: the figures are about the pipeline,
not the draft. Epoch 0 includes the start of the prefetch; the JSON reports every epoch and the mean
of the later ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serving import random_prepared
from eagle3.client.train_source import ServerSource
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir
from eagle3.core.protocol.prepared import iter_prepared
from eagle3.draft_trainer.config import load_config
from eagle3.draft_trainer.train import METRICS_FILE, train
from eagle3.draft_trainer.vocab import build_draft_vocab, save_vocab
from eagle3.local_server import LocalServer

HIDDEN, LAYERS = 64, 8


def tiny_verifier(root: Path) -> Path:
    """A random bf16 Llama (hidden 64, 8 layers) with SmolLM2's tokenizer files and vocabulary."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smol = resolve_model_dir(DEFAULT_MODEL)
    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smol / name).is_file():
            shutil.copy(smol / name, root / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(str(smol))), hidden_size=HIDDEN,
                         intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=4096)  # fmt: skip
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root)
    return root


def full_vocab(prepared: Path, out: Path, vocab_size: int) -> Path:
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    for sample in iter_prepared(prepared):
        np.add.at(counts, [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m], 1)
    vocab, stats = build_draft_vocab(counts, vocab_size)  # every teacher argmax is in it (random states)
    save_vocab(vocab, stats, counts, out)
    return out


def one_run(root: Path, name: str, model: Path, prepared: Path, vocab: Path, args: argparse.Namespace,
            tokens_per_s: float | None) -> dict[str, Any]:  # fmt: skip
    server_args = ["--backend", "synthetic", "--model", str(model), "--synthetic-hidden-size", str(HIDDEN),
                   "--synthetic-num-layers", str(LAYERS), "--dtype", "bfloat16"]  # fmt: skip
    if tokens_per_s:
        server_args += ["--synthetic-tokens-per-s", f"{tokens_per_s:.0f}"]
    run = root / name
    with LocalServer(server_args, root / f"{name}.log") as server:
        server.wait_ready(timeout_s=300)
        cfg = load_config(None, {"prepared": str(prepared), "vocab": str(vocab), "model": str(model), "out": str(run),
                                 "epochs": args.epochs, "max_batch_tokens": args.max_batch_tokens, "ttt_steps": 2,
                                 "torch_threads": args.threads, "device": "cpu", "progress": False,
                                 "checkpoint_every_steps": 10_000, "heldout_fraction": 0.02})  # fmt: skip
        started = time.monotonic()
        # cache "bypass": every epoch computed again (the server's feature cache would serve the repeats)
        train(cfg, ServerSource([server.url], requests_per_server=args.requests_per_server, cache="bypass"))
        wall_s = time.monotonic() - started
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    epochs = [r for r in records if r.get("epoch_data")]
    keep = ("epoch", "epoch_wall_s", "data_wait_share", "server_idle_share", "tokens_per_s", "fetch_tokens_per_s",
            "prefetch_bytes")  # fmt: skip
    later = epochs[1:] or epochs

    def mean(key: str) -> float:
        return round(float(sum(r.get(key, 0.0) for r in later)) / max(1, len(later)), 4)

    return {
        "server_tokens_per_s_limit": tokens_per_s,
        "wall_s": round(wall_s, 1),
        "epochs": [{k: (round(r[k], 4) if isinstance(r.get(k), float) else r.get(k)) for k in keep} for r in epochs],
        "later_epochs_mean": {k: mean(k) for k in ("data_wait_share", "server_idle_share", "tokens_per_s")},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=10_000, help="training tokens per epoch (default 10000)")
    p.add_argument("--p50", type=int, default=100, help="median sample length (default 100; at most 4x)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="trainer torch threads (default 1)")
    p.add_argument("--requests-per-server", type=int, default=2)
    p.add_argument("--slow-fraction", type=float, default=0.5, help="slow server's rate / the trainer's (0.5)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-train-stream-") as tmp:
        root = Path(tmp)
        model = tiny_verifier(root / "model")
        prepared, n_samples, n_tokens = random_prepared(root / "prepared", args.tokens, p50=args.p50)
        vocab = full_vocab(prepared, root / "vocab", json.loads((model / "config.json").read_text())["vocab_size"])
        fast = one_run(root, "fast", model, prepared, vocab, args, None)
        trainer_rate = fast["later_epochs_mean"]["tokens_per_s"]
        slow = one_run(root, "slow", model, prepared, vocab, args, args.slow_fraction * trainer_rate)
    out = {
        "samples": n_samples,
        "tokens": n_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "bytes_per_token": 4 * HIDDEN * 2,
        "fast_server": fast,
        "slow_server": slow,
        "bars": {
            "fast_server_data_wait_share_below_5pct": fast["later_epochs_mean"]["data_wait_share"] < 0.05,
            "slow_server_idle_share_below_5pct": slow["later_epochs_mean"]["server_idle_share"] < 0.05,
        },
    }
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
