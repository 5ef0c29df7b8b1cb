"""Time to first sample of a notebook's 1-sample requests while a bulk job saturates the server, with the
interactive lane (server/lanes.py) on and off, side by side in one run.

    .venv/bin/python bench/interactive_lane.py                  # ~2 min here
    .venv/bin/python bench/interactive_lane.py --backend hf     # the embedded SmolLM2 instead (noisier on CPU)

Server: ``eagle3 serve --backend synthetic --synthetic-tokens-per-s R`` (``--max-batch-tokens B``): a
forward pass lasts B / R seconds (250 ms by default) like a verifier of that speed, and the states
cost nothing to make, so what is measured is the scheduling. No feature cache (every sample is
computed). ``--backend hf`` runs SmolLM2 instead.

Load: a subprocess of tenant ``bulk`` keeps two requests of ``--bulk-request-tokens`` in flight (every
pass full); tenant ``notebook`` sends ``--probes`` 1-sample requests of ``--probe-tokens`` random tokens,
one at a time, 0.2-0.6 s apart, and times each from the call to its sample decoded. Phases alternate
lane on / lane off (``--interactive-max-tokens 0``), a fresh server each, ``--phases`` of each.

One forward pass: measured per phase before the probes start (``eagle3_stage_seconds_total{stage=
"forward"}`` over ``eagle3_forward_passes_total`` with the bulk job alone). Bar (issue 15): p95 time to
first sample with the lane <= 1.5x one forward pass. Prints one JSON object (also the server's own
``eagle3_time_to_first_sample_seconds`` per lane).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.client.sdk import ExtractionClient  # noqa: E402
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402

KEYS = {"bulk": "key-bulk", "notebook": "key-notebook"}
VOCAB = 49152  # SmolLM2's (the synthetic backend uses its tokenizer)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def bulk_main(url: str, request_tokens: int, seconds: float) -> None:
    """``--bulk URL TOKENS SECONDS``: two threads, each one request of ``request_tokens`` in flight."""

    def loop(seed: int) -> None:
        rng = random.Random(seed)  # noqa: S311 (load generation)
        with ExtractionClient(url, KEYS["bulk"], max_retries=0, timeout_s=120) as client:
            deadline = time.monotonic() + seconds
            k = 0
            while time.monotonic() < deadline:
                samples = [{"id": f"b{seed}-{k}-{i}", "input_ids": random_ids(rng, 256)}
                           for i in range(request_tokens // 256)]  # fmt: skip
                for _ in client.extract_stream(samples, "none"):
                    pass
                k += 1

    threads = [threading.Thread(target=loop, args=(seed,), daemon=True) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS['bulk']}"}, timeout=10.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def one_pass_s(url: str, window_s: float) -> dict[str, float]:
    """Mean forward pass and batch fill over ``window_s`` of the bulk job alone."""
    before = scrape(url)
    time.sleep(window_s)
    after = scrape(url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    passes = d["eagle3_forward_passes_total"]
    return {
        "forward_s": d["eagle3_stage_seconds_total|stage=forward"] / passes,
        "fill": d["eagle3_batch_fill_ratio_sum"] / d["eagle3_batch_fill_ratio_count"],
        "passes": passes,
    }


def phase(lane_on: bool, args: argparse.Namespace, tmp: Path, seed: int) -> dict[str, Any]:
    keys_file = tmp / "keys.txt"
    keys_file.write_text("".join(f"{t}: {k}\n" for t, k in KEYS.items()))
    server_args = ["--api-keys-file", str(keys_file), "--max-batch-tokens", str(args.max_batch_tokens),
                   "--cache-memory-mb", "0", "--interactive-max-tokens", "2048" if lane_on else "0"]  # fmt: skip
    if args.backend == "synthetic":
        server_args += ["--backend", "synthetic", "--synthetic-hidden-size", "256",
                        "--synthetic-tokens-per-s", str(args.tokens_per_s)]  # fmt: skip
    else:
        server_args += ["--backend", "hf", "--model", str(resolve_model_dir(DEFAULT_MODEL))]
    name = f"lane-{'on' if lane_on else 'off'}-{seed}"
    with LocalServer(server_args, tmp / f"{name}.log") as live:
        live.wait_ready(timeout_s=600)
        seconds = 600.0
        bulk = subprocess.Popen(  # noqa: S603 (our own script)
            [sys.executable, __file__, "--bulk", live.url, str(args.bulk_request_tokens), str(seconds)]
        )
        try:
            time.sleep(2.0)  # the bulk job fills the pipeline
            alone = one_pass_s(live.url, args.window_s)
            rng = random.Random(seed)  # noqa: S311
            ttfs: list[float] = []
            with ExtractionClient(live.url, KEYS["notebook"], max_retries=0) as client:
                client.info()  # the SDK reads the limits once: not part of any probe
                for i in range(args.probes + 1):
                    time.sleep(rng.uniform(0.2, 0.6))
                    sample = {"id": f"p{i}", "input_ids": random_ids(rng, args.probe_tokens)}
                    started = time.perf_counter()
                    got = list(client.extract([sample], "none"))
                    if i and got:  # the first probe opens the connection: not counted
                        ttfs.append(time.perf_counter() - started)
            m = scrape(live.url)
        finally:
            bulk.kill()
            bulk.wait()
    server_ttfs = {}
    for lane in ("interactive", "bulk"):
        count = m.get(f"eagle3_time_to_first_sample_seconds_count|lane={lane}", 0.0)
        total = m.get(f"eagle3_time_to_first_sample_seconds_sum|lane={lane}", 0.0)
        server_ttfs[lane] = {"count": count, "mean_s": round(total / count, 4) if count else None}
    return {"lane": lane_on, "bulk_alone": alone, "ttfs_s": ttfs, "server_ttfs": server_ttfs}


def summary(phases: list[dict[str, Any]]) -> dict[str, Any]:
    ttfs = np.array([t for p in phases for t in p["ttfs_s"]])
    forward_s = float(np.mean([p["bulk_alone"]["forward_s"] for p in phases]))
    p95 = float(np.percentile(ttfs, 95))
    return {
        "n_probes": int(ttfs.size),
        "one_forward_pass_s": round(forward_s, 4),
        "bulk_batch_fill": round(float(np.mean([p["bulk_alone"]["fill"] for p in phases])), 3),
        "ttfs_p50_s": round(float(np.percentile(ttfs, 50)), 4),
        "ttfs_p95_s": round(p95, 4),
        "ttfs_max_s": round(float(ttfs.max()), 4),
        "p95_over_forward_pass": round(p95 / forward_s, 3),
        "server_ttfs": [p["server_ttfs"] for p in phases],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("synthetic", "hf"), default="synthetic")
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--tokens-per-s", type=float, default=16384.0, help="synthetic: simulated forward speed")
    parser.add_argument("--bulk-request-tokens", type=int, default=16384)
    parser.add_argument("--probe-tokens", type=int, default=64)
    parser.add_argument("--probes", type=int, default=20, help="per phase")
    parser.add_argument("--phases", type=int, default=2, help="per setting (lane on, lane off), alternating")
    parser.add_argument("--window-s", type=float, default=3.0, help="bulk alone: the forward pass measurement")
    args = parser.parse_args()
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-lane-") as tmp_name:
        for k in range(args.phases):
            for lane_on in (True, False) if k % 2 == 0 else (False, True):
                phases.append(phase(lane_on, args, Path(tmp_name), seed=k))
    on = summary([p for p in phases if p["lane"]])
    off = summary([p for p in phases if not p["lane"]])
    result = {
        "backend": args.backend,
        "max_batch_tokens": args.max_batch_tokens,
        "synthetic_tokens_per_s": args.tokens_per_s if args.backend == "synthetic" else None,
        "probe_tokens": args.probe_tokens,
        "bulk_request_tokens": args.bulk_request_tokens,
        "lane_on": on,
        "lane_off": off,
        "p95_lane_off_over_on": round(off["ttfs_p95_s"] / on["ttfs_p95_s"], 2),
        "bar_p95_over_forward_pass": 1.5,
        "pass": on["p95_over_forward_pass"] <= 1.5,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--bulk":
        bulk_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
