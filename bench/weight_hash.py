"""The first-start cost of identity by content: how fast a checkpoint's weights are hashed.

``checkpoint_revision`` reads every weight byte once per file (``core/file_digests.py``: xxh3-128 in
16 MiB chunks), then remembers each digest. This measures, on one file of ``--gb`` random bytes:

* ``memory``: xxh3-128 of bytes already in memory (the hash's own ceiling);
* ``warm``: ``hash_file`` on a file in the page cache (what a server sees when the engine has just
  read the weights, or the host's memory holds them);
* ``cold``: ``hash_file`` after the file's pages were dropped from the page cache
  (``posix_fadvise(DONTNEED)`` after an fsync; no root needed), i.e. read from the disk;
* ``restart``: ``checkpoint_revision`` of a checkpoint with that file once its digest is remembered;

and extrapolates the first start of a 500 GB checkpoint from the cold and warm rates.

    .venv/bin/python bench/weight_hash.py --gb 2      # ~30 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.core.file_digests import FileDigests, hash_file  # noqa: E402
from eagle3.core.identity import checkpoint_revision  # noqa: E402

CHECKPOINT_GB = 500


def rate_gb_s(n_bytes: int, seconds: float) -> float:
    return round(n_bytes / seconds / 1e9, 3)


def drop_cache(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the test file (GB)")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temporary dir on this disk)")
    args = parser.parse_args()
    n_bytes = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="eagle3-hash-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        weights = ckpt / "model.safetensors"
        block = os.urandom(64 << 20)
        with open(weights, "wb") as fh:
            written = 0
            while written < n_bytes:
                fh.write(block[: n_bytes - written])
                written += min(len(block), n_bytes - written)

        started = time.perf_counter()
        for _ in range(4):
            xxhash.xxh3_128(block).digest()
        memory = rate_gb_s(4 * len(block), time.perf_counter() - started)

        hash_file(weights)  # into the page cache
        started = time.perf_counter()
        hash_file(weights)
        warm = rate_gb_s(n_bytes, time.perf_counter() - started)

        drop_cache(weights)
        started = time.perf_counter()
        hash_file(weights)
        cold = rate_gb_s(n_bytes, time.perf_counter() - started)

        digests = Path(tmp) / "digests"
        checkpoint_revision(ckpt, FileDigests(digests))
        again = FileDigests(digests)
        started = time.perf_counter()
        checkpoint_revision(ckpt, again)
        restart_s = time.perf_counter() - started

    print(
        json.dumps(
            {
                "file_gb": args.gb,
                "cpus": os.cpu_count(),
                "xxh3_128_memory_gb_s": memory,
                "hash_file_warm_gb_s": warm,
                "hash_file_cold_gb_s": cold,
                "restart_s": round(restart_s, 4),
                "restart_bytes_read": again.hashed_bytes,
                f"first_start_{CHECKPOINT_GB}gb_cold_min": round(CHECKPOINT_GB / cold / 60, 1),
                f"first_start_{CHECKPOINT_GB}gb_warm_min": round(CHECKPOINT_GB / warm / 60, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
