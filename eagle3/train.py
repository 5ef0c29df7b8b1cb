"""``python -m eagle3.train ARGS`` = ``eagle3 train ARGS``: the entry point for ``torchrun``; and training
streamed from extraction servers, where the trainer meets the SDK (``draft_trainer`` never imports it).

torchrun --nproc-per-node 2 -m eagle3.train --features F --vocab V --model M --out RUN
torchrun --nproc-per-node 2 -m eagle3.train --prepared P --server URL --vocab V --model M --out RUN

Python::

    from eagle3 import train_from_servers
    from eagle3.draft_trainer.config import load_config
    cfg = load_config(None, {"prepared": "prepared/", "vocab": "prepared/vocab-32000", "model": "/models/v",
                             "out": "run/", "features_cache": "features/"})  # hybrid; leave it out: consume once
    result = train_from_servers(cfg, ["http://gpu-a:8000", "http://gpu-b:8000"])
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from eagle3.client.train_source import DEFAULT_TRAIN_MAX_RETRIES, ServerSource
from eagle3.core.protocol.features import FEATURE_DTYPES


def train_from_servers(
    cfg: Any,
    urls: str | Sequence[str],
    api_key: str | None = None,
    *,
    requests_per_server: int = 2,
    max_retries: int = DEFAULT_TRAIN_MAX_RETRIES,
    wait_ready_s: float | None = None,
    feature_dtype: str = "bfloat16",
    compress_shards: bool = False,
) -> Any:
    """Train ``cfg`` (a ``TrainConfig`` with ``prepared`` set, ``features`` empty; ``features_cache`` for
    the hybrid mode) on features streamed from ``urls``; returns ``draft_trainer.train.RunResult``.
    ``feature_dtype``: ``"bfloat16"`` (lossless) or ``"float8_e4m3fn"`` (FP8 on the wire and in the cache);
    ``compress_shards``: the hybrid cache's shards compressed at rest."""
    from eagle3.draft_trainer.train import train

    source = ServerSource(
        urls,
        api_key,
        requests_per_server=requests_per_server,
        max_retries=max_retries,
        wait_ready_s=wait_ready_s,
        dtype=feature_dtype,
        compress_shards=compress_shards,
    )
    return train(cfg, source)


def server_source(args: argparse.Namespace) -> ServerSource:
    """``eagle3 train --server URL ...``'s source (``draft_trainer/cli.py`` adds the options)."""
    return ServerSource(
        args.server,
        requests_per_server=args.requests_per_server,
        wait_ready_s=args.wait_ready_s,
        dtype=FEATURE_DTYPES[args.feature_dtype],
        compress_shards=args.compress_shards,
    )


if __name__ == "__main__":
    from eagle3.cli import main

    raise SystemExit(main(["train", *sys.argv[1:]]))
