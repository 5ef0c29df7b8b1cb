"""Features at rest: bytes per token and the trainer's loader read rate for each format, side by side. Prints JSON.

    python -m bench.feature_formats --features FEATURES [--hidden native,4096] [--tokens 16384]
        [--max-batch-tokens 2048] [--repeat 3] [--trainer-metrics RUN/metrics.jsonl]

For each shape (``native``: the directory's own states; ``4096`` etc.: the same values re-cut into rows
of that width, so the value statistics, and with them zstd's ratio, stay those of real states), the
first ``--tokens`` tokens are written as raw bf16 (the default), bf16 + zstd+planes, FP8 and FP8 + zstd
(``core/features_convert.py``), then the trainer's own loader (``draft_trainer.data.FeaturesData.load``:
read, decompress, dequantize or widen to float32, pack) loads the micro-batches of one epoch plan;
tokens/s is the best of ``--repeat`` passes (torch on one thread; ``--loader-threads`` 0: each
micro-batch read inside the step, N: read ahead on N threads, as training does by default), the files
in the page cache (what a
second epoch sees; a cold first read is bounded by the disk: divide its MB/s by bytes per token).

The loader rate is compared with the trainer's consumption rate: measured here (``--trainer-metrics``:
the median tokens / step_s of a run's metrics.jsonl, e.g. ``make demo``'s) and the H200 figure of
docs/performance.md (21,711 tokens/s, llama8b shape: hidden 4096, 4 stored layers). The loader runs in
the training loop (``data_s``), so its share of a step is consumption / loader rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.core.features_convert import convert_features
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import DTYPE_BF16, DTYPE_FP8, SHARDS_DIR
from eagle3.core.sample import ExtractedSample

SAMPLE_TOKENS = 512  # re-cut shapes: tokens per sample
H200_TRAINER_TOKENS_PER_S = 21_711  # docs/performance.md: llama8b, flex attention, 8,192-token micro-batches
FORMATS = (("raw", DTYPE_BF16, False), ("zstd+planes", DTYPE_BF16, True), ("fp8", DTYPE_FP8, False),
           ("fp8+zstd", DTYPE_FP8, True))  # fmt: skip


def source_dir(features: Path, hidden: str, n_tokens: int, out: Path) -> Path:
    """The first ``n_tokens`` tokens of ``features`` as a raw directory: its own samples (``native``), or
    each layer's values re-cut into rows ``hidden`` wide, in samples of ``SAMPLE_TOKENS``."""
    import dataclasses

    reader = FeaturesReader(features)
    width = reader.meta.hidden_size if hidden == "native" else int(hidden)
    writer = FeaturesWriter.open(out, dataclasses.replace(reader.meta, hidden_size=width), shard_mb=64)
    if hidden == "native":
        written = 0
        for sample in reader:
            if written >= n_tokens:
                break
            writer.add(sample)
            written += sample.n_tokens
        writer.close()
        return out
    pieces, n_values = [], 0
    for sample in reader:  # bf16 bits [n, L, H_src] -> per layer [L, n * H_src]
        pieces.append(np.asarray(sample.states).transpose(1, 0, 2).reshape(sample.states.shape[1], -1))
        n_values += pieces[-1].shape[1]
        if n_values >= n_tokens * width:
            break
    per_layer = np.concatenate(pieces, axis=1)
    n_rows = min(n_tokens, per_layer.shape[1] // width)
    rows = per_layer[:, : n_rows * width].reshape(per_layer.shape[0], n_rows, width).transpose(1, 0, 2)
    rng = np.random.default_rng(0)
    for index, start in enumerate(range(0, n_rows, SAMPLE_TOKENS)):
        states = np.ascontiguousarray(rows[start : start + SAMPLE_TOKENS])
        n = states.shape[0]
        ids = np.asarray(rng.integers(0, reader.meta.vocab_size, n), dtype=np.int32)
        mask = np.ones(n, np.uint8)
        writer.add(
            ExtractedSample(f"s{index:06d}", ids, mask, states, reader.meta.aux_layer_ids, reader.meta.final_layer_id)
        )
    writer.close()
    return out


def loader_rate(features: Path, max_batch_tokens: int, repeat: int, threads: int, compact: bool) -> dict[str, float]:
    """The trainer's loader over one epoch plan: ``threads`` 0 reads each micro-batch in the step (as
    it would without read-ahead), N > 0 reads ahead on N threads (``begin``). ``compact``: the host's part
    of CUDA training (the states gathered as stored; the widening happens on the GPU, not timed here)."""
    from eagle3.draft_trainer.data import FeaturesData

    data = FeaturesData(features, heldout_fraction=0.0001)
    plan = data.plan(data.split.train, max_batch_tokens, seed=0, epoch=0)
    tokens = int(sum(int(data.n_tokens[p]) for batch in plan for p in batch))
    best_s = float("inf")
    for _ in range(repeat):
        data = FeaturesData(features, heldout_fraction=0.0001, loader_threads=threads, compact=compact)  # fresh
        started = time.perf_counter()
        data.begin(plan)
        for batch in plan:
            data.read(batch, None)
        best_s = min(best_s, time.perf_counter() - started)
        data.close()
    shard_bytes = sum(p.stat().st_size for p in (features / SHARDS_DIR).iterdir())
    return {
        "tokens": tokens,
        "bytes_per_token": round(shard_bytes / tokens, 1),
        "loader_tokens_per_s": round(tokens / best_s),
        "loader_mb_per_s_of_shards": round(shard_bytes / best_s / 1e6, 1),
    }


def trainer_rate(metrics: Path) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["tokens"] / r["step_s"] for r in rows if r.get("step_s") and r.get("tokens")]
    return float(statistics.median(rates))


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--features", required=True, type=Path)
    parser.add_argument("--hidden", default="native,4096", help="row widths: native and/or integers")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per shape")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--loader-threads", default="0,2", help="0: read in the step; N: N read-ahead threads")
    parser.add_argument(
        "--batch",
        default="float32,compact",
        help="float32: widened on the host (CPU training); compact: as stored (CUDA)",
    )
    parser.add_argument("--trainer-metrics", type=Path, default=None, help="a run's metrics.jsonl (this machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    here = trainer_rate(args.trainer_metrics) if args.trainer_metrics else None
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="eagle3-formats-") as tmp:
        for hidden in args.hidden.split(","):
            raw = source_dir(args.features, hidden, args.tokens, Path(tmp) / f"h{hidden}-raw")
            meta = FeaturesReader(raw).meta
            for name, dtype, compress in FORMATS:
                path = raw if name == "raw" else Path(tmp) / f"h{hidden}-{name}"
                if name != "raw":
                    convert_features(raw, path, dtype, compress=compress, shard_mb=64)
                for threads, batch in (
                    (int(t), b) for t in args.loader_threads.split(",") for b in args.batch.split(",")
                ):
                    row: dict[str, Any] = {"hidden": meta.hidden_size, "layers": meta.n_layers_stored}
                    row |= {"format": name, "loader_threads": threads, "batch": batch}
                    row |= loader_rate(path, args.max_batch_tokens, args.repeat, threads, batch == "compact")
                    rate = row["loader_tokens_per_s"]
                    if meta.hidden_size == 4096 and meta.n_layers_stored == 4:  # the H200 figure's shape
                        row["loader_over_h200_trainer"] = round(rate / H200_TRAINER_TOKENS_PER_S, 2)
                    if here is not None:
                        row["loader_over_this_trainer"] = round(rate / here, 1)
                    results.append(row)
                    print(json.dumps(row), flush=True)
    summary = {
        "bench": "feature_formats",
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "max_batch_tokens": args.max_batch_tokens,
        "this_trainer_tokens_per_s": round(here, 1) if here is not None else None,
        "h200_trainer_tokens_per_s": H200_TRAINER_TOKENS_PER_S,
        "results": results,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
