"""The client's frame buffers, recycled or fresh: side by side against one synthetic server (prints JSON).

    .venv/bin/python -m bench.client_buffers                 # ~1 min here
    .venv/bin/python -m bench.client_buffers --tokens 40000 --reps 10

Two ``ExtractionClient`` s read the same samples from one ``eagle3 serve --backend synthetic`` (4 taps x
``--hidden-size`` bf16 per token, the feature cache off), one with a ``BufferPool`` (client/buffer_pool.py)
and one without (a fresh ``numpy.empty`` per frame body, as the SDK does by default), alternating which goes
first, after one untimed pass of each (the pool's first pass allocates; ``extract_dataset`` pays that once
per run, then recycles). Samples are dropped as they arrive (no disk: the shard writer's cost is the same
either way and its page-cache writes would add the machine's writeback noise). Per repetition: MB/s of
raw states and the client process's CPU seconds (user, system) per GB. Reported: medians and every value.
What the pool removes is the kernel zeroing fresh pages (``clear_page_erms``: 31-39 % of the reading
thread's samples under ``perf``, docs/performance.md "Serving path").
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import random_prepared  # noqa: E402
from eagle3.client.buffer_pool import BufferPool  # noqa: E402
from eagle3.client.sdk import ExtractionClient  # noqa: E402
from eagle3.core.protocol.prepared import iter_prepared  # noqa: E402
from eagle3.core.sample import ExtractedSample  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402


def cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def one_pass(client: ExtractionClient, samples: list[dict[str, Any]]) -> dict[str, float]:
    (user0, sys0), started, n_bytes = cpu_s(), time.perf_counter(), 0
    for item in client.extract_stream(samples):
        if not isinstance(item, ExtractedSample):
            raise RuntimeError(f"sample {item.sample_id!r} failed: {item.message}")
        n_bytes += item.states_nbytes
        del item  # dropped as it arrives: its buffer is free again
    wall_s = time.perf_counter() - started
    user1, sys1 = cpu_s()
    gb = n_bytes / 1e9
    return {
        "mb_per_s": n_bytes / wall_s / 1e6,
        "user_s_per_gb": (user1 - user0) / gb,
        "sys_s_per_gb": (sys1 - sys0) / gb,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--p50", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-client-buffers-"))
    try:
        prepared, n_samples, n_tokens = random_prepared(tmp / "prepared", args.tokens, args.p50)
        samples = [{"id": s.sample_id, "input_ids": s.input_ids} for s in iter_prepared(prepared)]
        server_args = ["--backend", "synthetic", "--synthetic-hidden-size", str(args.hidden_size)]
        server_args += ["--cache-memory-mb", "0"]
        runs: dict[str, list[dict[str, float]]] = {"pool": [], "fresh": []}
        pool = BufferPool(1 << 30)
        with LocalServer(server_args, tmp / "server.log") as server:
            server.wait_ready(timeout_s=600)
            with ExtractionClient(server.url, buffer_pool=pool) as pooled, ExtractionClient(server.url) as fresh:
                clients = {"pool": pooled, "fresh": fresh}
                for client in clients.values():  # untimed: the pool's first pass allocates
                    one_pass(client, samples)
                for rep in range(args.reps):
                    for name in ("pool", "fresh") if rep % 2 == 0 else ("fresh", "pool"):
                        runs[name].append(one_pass(clients[name], samples))
        result: dict[str, Any] = {
            "bench": "client_buffers",
            "n_samples": n_samples,
            "n_tokens": n_tokens,
            "raw_mb_per_pass": n_tokens * 4 * args.hidden_size * 2 / 1e6,
            "pool_reused": pool.n_reused,
            "pool_allocated": pool.n_allocated,
        }
        for name, rows in runs.items():
            result[name] = {
                key: round(statistics.median(r[key] for r in rows), 3)
                for key in ("mb_per_s", "user_s_per_gb", "sys_s_per_gb")
            } | {"mb_per_s_all": [round(r["mb_per_s"]) for r in rows]}
        result["pool_over_fresh_mb_per_s"] = round(result["pool"]["mb_per_s"] / result["fresh"]["mb_per_s"], 3)
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
