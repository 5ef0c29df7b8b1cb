"""``ExtractionClient.extract`` with 1, 2 and 4 requests in flight, side by side on one server (prints JSON).

    .venv/bin/python -m bench.sdk_requests                    # ~1 min here
    .venv/bin/python -m bench.sdk_requests --tokens-per-s 50000 --reps 5

The notebook path: one call whose samples need several requests (the server's ``--max-request-tokens``),
each sample used as it arrives (``--use``: turned into a float32 torch tensor and reduced, the least a
caller does with states). One ``eagle3 serve --backend synthetic`` with a simulated forward pass of
``--tokens-per-s`` (its states at memory speed, the feature cache off), so the server's time per request is
that of a GPU forward, not this CPU's. Sent one after the other, each request's forward pass waits for the
caller to finish the previous request's samples; with N in flight (``client/request_pipeline.py``) the
server computes the next request while the caller reads this one. Per repetition, the three settings
alternate their order; reported: tokens/s (median, every value) and each setting over one at a time.
"""

from __future__ import annotations

import argparse
import json
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
from eagle3.client.sdk import ExtractionClient  # noqa: E402
from eagle3.core.protocol.prepared import iter_prepared  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402

SETTINGS = (1, 2, 4)


def one_call(client: ExtractionClient, samples: list[dict[str, Any]], use: bool) -> dict[str, float]:
    started, n_tokens, total = time.perf_counter(), 0, 0.0
    for item in client.extract(samples):
        n_tokens += item.n_tokens
        if use:
            total += float(item.as_torch().float().mean())
    wall_s = time.perf_counter() - started
    return {"tokens_per_s": n_tokens / wall_s, "wall_s": wall_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=24000, help="tokens per call")
    p.add_argument("--p50", type=int, default=512, help="median sample length")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--tokens-per-s", type=float, default=20000.0, help="the simulated forward pass")
    p.add_argument("--max-request-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-use", dest="use", action="store_false", help="drop samples as they arrive")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-sdk-requests-"))
    try:
        prepared, n_samples, n_tokens = random_prepared(tmp / "prepared", args.tokens, args.p50)
        samples = [{"id": s.sample_id, "input_ids": s.input_ids} for s in iter_prepared(prepared)]
        server_args = ["--backend", "synthetic", "--synthetic-hidden-size", str(args.hidden_size),
                       "--synthetic-tokens-per-s", str(args.tokens_per_s), "--cache-memory-mb", "0",
                       "--max-request-tokens", str(args.max_request_tokens)]  # fmt: skip
        runs: dict[int, list[dict[str, float]]] = {n: [] for n in SETTINGS}
        with LocalServer(server_args, tmp / "server.log") as server:
            server.wait_ready(timeout_s=600)
            clients = {n: ExtractionClient(server.url, max_in_flight_requests=n) for n in SETTINGS}
            try:
                for client in clients.values():  # untimed: connections, first allocations
                    one_call(client, samples[: max(1, len(samples) // 4)], args.use)
                for rep in range(args.reps):
                    order = SETTINGS[rep % len(SETTINGS) :] + SETTINGS[: rep % len(SETTINGS)]
                    for n in order:
                        runs[n].append(one_call(clients[n], samples, args.use))
            finally:
                for client in clients.values():
                    client.close()
        base = statistics.median(r["tokens_per_s"] for r in runs[1])
        result: dict[str, Any] = {
            "bench": "sdk_requests",
            "n_samples": n_samples,
            "n_tokens": n_tokens,
            "hidden_size": args.hidden_size,
            "raw_mb_per_call": n_tokens * 4 * args.hidden_size * 2 / 1e6,
            "server_tokens_per_s": args.tokens_per_s,
            "max_request_tokens": args.max_request_tokens,
            "caller_uses_samples": args.use,
        }
        for n, rows in runs.items():
            median = statistics.median(r["tokens_per_s"] for r in rows)
            result[f"in_flight_{n}"] = {
                "tokens_per_s": round(median),
                "tokens_per_s_all": [round(r["tokens_per_s"]) for r in rows],
                "over_one_at_a_time": round(median / base, 3),
            }
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
