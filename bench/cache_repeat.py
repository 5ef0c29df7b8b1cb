"""The feature cache on a CI-style repeat, and what it costs a cold run, side by side in one run.

    .venv/bin/python bench/cache_repeat.py                 # SmolLM2 (hf, bf16), 64 chatterbot samples, ~3 min here
    .venv/bin/python bench/cache_repeat.py --data mixed    # longer multi-turn samples (~40-500 tokens)
    .venv/bin/python bench/cache_repeat.py --backend synthetic --rounds 6   # SmolLM2-shaped states at a fixed
        # simulated forward speed (--synthetic-tokens-per-s): the cache's own cost without the CPU's noise

Two live ``eagle3 serve`` processes on the embedded SmolLM2 (hf backend, the server's defaults): ``on``
with a disk tier (``--feature-cache-dir``) next to its default memory tier, ``off`` with no cache
(``--cache-memory-mb 0``). Every extraction is a whole ``extract_dataset`` (``/v1/info`` checks,
HTTP, decode, shards on disk), timed from the call to its return.

* repeat: the same ``--samples`` samples extracted twice from ``on`` (cold, then warm from memory), then
  once more from a new ``on`` process on the same directory (warm from disk after a restart); every
  array of the three feature directories compared bitwise. Bar (issue 15): warm >= 20x faster.
* cold cost: ``--rounds`` rounds, each on ``--samples`` samples not seen before by either server,
  extracted by both (the order alternates per round to cancel drift); the cache's cost is the
  total wall time of ``on`` over ``off``, minus 1. Bar: < 5 %.

Prints one JSON object.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.extract import mixed_conversations  # noqa: E402
from eagle3.client.extract import ExtractConfig, extract_dataset  # noqa: E402
from eagle3.client.prepare import PrepareConfig, prepare_dataset  # noqa: E402
from eagle3.core.conversations import BUILTIN_CHATTERBOT  # noqa: E402
from eagle3.core.features_reader import FeaturesReader  # noqa: E402
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.core.protocol import META_FILE, SAMPLES_FILE, iter_prepared  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402


def blocks(prepared: Path, out: Path, n_blocks: int, n_samples: int) -> list[tuple[Path, int]]:
    """``n_blocks`` prepared directories of ``n_samples`` distinct samples each: ``(dir, tokens)``."""
    rows, seen = [], set()
    for s in iter_prepared(prepared):  # chatterbot repeats some dialogs: a cold run must hold no repeat
        if tuple(s.input_ids) not in seen:
            seen.add(tuple(s.input_ids))
            rows.append(s)
    if len(rows) < n_blocks * n_samples:
        raise SystemExit(f"{prepared} has {len(rows)} samples, fewer than {n_blocks} x {n_samples}")
    result = []
    for b in range(n_blocks):
        d = out / f"block{b}"
        d.mkdir(parents=True)
        shutil.copy(prepared / META_FILE, d / META_FILE)
        chunk = rows[b * n_samples : (b + 1) * n_samples]
        with open(d / SAMPLES_FILE, "w") as fh:
            for s in chunk:
                line = {"id": s.sample_id, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "source": s.source}
                fh.write(json.dumps(line) + "\n")
        result.append((d, sum(s.n_tokens for s in chunk)))
    return result


SERVER_S: dict[str, float] = {}  # step -> the server's own seconds (eagle3_request_duration_seconds)


def timed_extract(prepared: Path, out: Path, url: str) -> float:
    """Wall seconds of a whole ``extract_dataset``; the server's seconds for its requests go to SERVER_S."""
    before = scrape(url, "eagle3_request_duration_seconds_sum")
    started = time.perf_counter()
    summary = extract_dataset(prepared, out, url, config=ExtractConfig(progress=False))
    elapsed = time.perf_counter() - started
    if summary.n_failed:
        raise SystemExit(f"{summary.n_failed} samples failed")
    SERVER_S[out.name] = scrape(url, "eagle3_request_duration_seconds_sum") - before
    step = {"step": out.name, "wall_s": round(elapsed, 3), "server_s": round(SERVER_S[out.name], 3)}
    print(json.dumps(step), file=sys.stderr, flush=True)  # progress, in case the run is cut short
    return elapsed


def read_features(path: Path) -> dict[str, np.ndarray]:
    with FeaturesReader(path, verify=True) as reader:
        return {s.sample_id: np.array(s.hidden_states_bf16) for s in reader}


def identical(a: Path, b: Path) -> bool:
    fa, fb = read_features(a), read_features(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


def server(args: list[str], log: Path) -> LocalServer:
    live = LocalServer(args, log).start()
    live.wait_ready(timeout_s=600)
    return live


def scrape(url: str, name: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--samples", type=int, default=64, help="samples per extraction")
    parser.add_argument("--rounds", type=int, default=4, help="cold rounds per server for the cost figure")
    parser.add_argument("--data", choices=("chatterbot", "mixed"), default="chatterbot")
    parser.add_argument("--backend", choices=("hf", "synthetic"), default="hf")
    parser.add_argument("--synthetic-tokens-per-s", type=float, default=2000.0, help="synthetic: forward speed")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-cache-") as tmp_name:
        tmp = Path(tmp_name)
        sources = BUILTIN_CHATTERBOT if args.data == "chatterbot" else [str(mixed_conversations(tmp / "mixed.jsonl"))]
        prepare_dataset(sources, tmp / "full", model=str(model_dir), config=PrepareConfig())
        data = blocks(tmp / "full", tmp / "blocks", 1 + args.rounds, args.samples)
        base = ["--model", str(model_dir), "--backend", args.backend]
        if args.backend == "synthetic":  # SmolLM2's shape: 30 layers (4 taps), hidden 576
            base += ["--synthetic-hidden-size", "576", "--synthetic-num-layers", "30",
                     "--synthetic-tokens-per-s", str(args.synthetic_tokens_per_s)]  # fmt: skip
        on_args = [*base, "--feature-cache-dir", str(tmp / "cache")]
        on = server(on_args, tmp / "on.log")
        off = server([*base, "--cache-memory-mb", "0"], tmp / "off.log")
        try:
            repeat_dir, repeat_tokens = data[0]
            cold_s = timed_extract(repeat_dir, tmp / "r-cold", on.url)
            warm_s = timed_extract(repeat_dir, tmp / "r-warm", on.url)
            hits = scrape(on.url, "eagle3_cache_hits_total")
            on.stop()
            on = server(on_args, tmp / "on2.log")
            disk_s = timed_extract(repeat_dir, tmp / "r-disk", on.url)
            disk_hits = scrape(on.url, "eagle3_cache_hits_total")
            off_repeat_s = timed_extract(repeat_dir, tmp / "r-off", off.url)
            same = identical(tmp / "r-cold", tmp / "r-warm") and identical(tmp / "r-cold", tmp / "r-disk")
            same_as_off = identical(tmp / "r-cold", tmp / "r-off")

            rounds: list[dict[str, Any]] = []
            for r, (block, n_tokens) in enumerate(data[1:], start=1):
                order = [("on", on), ("off", off)] if r % 2 else [("off", off), ("on", on)]
                row: dict[str, Any] = {"n_tokens": n_tokens, "first": order[0][0]}
                for name, live in order:
                    row[f"{name}_s"] = round(timed_extract(block, tmp / f"c{r}-{name}", live.url), 3)
                rounds.append(row)
            misses = scrape(on.url, "eagle3_cache_misses_total")
        finally:
            on.stop()
            off.stop()
        on_total = sum(r["on_s"] for r in rounds)
        off_total = sum(r["off_s"] for r in rounds)
        result = {
            "model": str(args.model),
            "backend": args.backend,
            "synthetic_tokens_per_s": args.synthetic_tokens_per_s if args.backend == "synthetic" else None,
            "data": args.data,
            "repeat": {
                "n_samples": args.samples,
                "n_tokens": repeat_tokens,
                "cold_s": round(cold_s, 3),
                "warm_memory_s": round(warm_s, 3),
                "warm_disk_after_restart_s": round(disk_s, 3),
                "speedup_memory": round(cold_s / warm_s, 1),
                "speedup_disk": round(cold_s / disk_s, 1),
                "server_s": {k: round(SERVER_S[k], 3) for k in ("r-cold", "r-warm", "r-disk", "r-off")},
                "server_speedup_memory": round(SERVER_S["r-cold"] / SERVER_S["r-warm"], 1),
                "memory_hits": hits,
                "disk_hits_after_restart": disk_hits,
                "bitwise_identical": same,
                "cache_off_server_s": round(off_repeat_s, 3),
                "cache_off_server_bitwise_identical": same_as_off,
                "bar_speedup": 20,
                "pass": same and cold_s / warm_s >= 20,
            },
            "cold_cost": {
                "rounds": rounds,
                "on_total_s": round(on_total, 3),
                "off_total_s": round(off_total, 3),
                "overhead": round(on_total / off_total - 1, 4),
                "per_round_overhead": [round(r["on_s"] / r["off_s"] - 1, 4) for r in rounds],
                "misses_on_server_after_restart": misses,
                "bar_overhead": 0.05,
                "pass": on_total / off_total - 1 < 0.05,
            },
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
