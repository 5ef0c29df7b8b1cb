"""The head-to-head table of docs/draft-quality.md from the runs' files: τ in vLLM per prompt set and k, train time,
peak memory, for eagle3 and the peer trainer (bench/peer_speculators.py). Prints Markdown, then JSON.

    python -m bench.peer_table --eval eagle3=EVAL.json --eval speculators=EVAL.json \
        --time eagle3=TRAIN.log --time speculators=TRAIN.log

``EVAL.json``: ``eagle3 eval --engine vllm ... --json`` with several sets or k (``{"matrix": [...]}``).
``TRAIN.log``: a log holding GNU ``/usr/bin/time -v``'s report of the training process (wall clock, maximum
resident set size); ``--metrics NAME=RUN/run/metrics.jsonl``: an eagle3 run's train time where no such log exists
(a demo trains in-process).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


def parse_time_v(text: str) -> dict[str, float]:
    """Wall seconds and peak RSS bytes from ``/usr/bin/time -v`` output (the last report in ``text``)."""
    walls = re.findall(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)", text)
    rss = re.findall(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if not walls or not rss:
        raise ValueError("no /usr/bin/time -v report (Elapsed (wall clock) time, Maximum resident set size)")
    seconds = 0.0
    for part in walls[-1].split(":"):
        seconds = seconds * 60 + float(part)
    return {"train_s": seconds, "peak_rss_bytes": float(rss[-1]) * 1024}


def metrics_train_s(path: Path) -> dict[str, float]:
    """Train wall seconds from an eagle3 run's metrics.jsonl: first step's start to the last record."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step_s" in r]
    if not steps:
        raise ValueError(f"{path}: no step records")
    return {"train_s": records[-1]["time"] - steps[0]["time"] + steps[0]["step_s"]}


def taus(eval_json: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    cells = eval_json.get("matrix") or [eval_json]
    return {
        (c.get("prompt_set", "heldout"), int(c["k"])): {
            "tau": c["mean_acceptance_length"],
            "per_pos": c.get("acceptance_rate_per_pos"),
            "identical": c.get("outputs_identical"),
            "n_prompts": c.get("n_prompts"),
        }
        for c in cells
    }


def _pairs(values: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {value!r}: expected NAME=PATH")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=EVAL.json")
    parser.add_argument("--time", action="append", default=[], metavar="NAME=TRAIN.log")
    parser.add_argument(
        "--metrics", action="append", default=[], metavar="NAME=metrics.jsonl", help="an eagle3 run's train time"
    )
    args = parser.parse_args(argv)
    evals = {n: taus(json.loads(p.read_text())) for n, p in _pairs(args.eval, "--eval").items()}
    times = {n: parse_time_v(p.read_text(errors="replace")) for n, p in _pairs(args.time, "--time").items()}
    times.update({n: metrics_train_s(p) for n, p in _pairs(args.metrics, "--metrics").items() if n not in times})
    keys = sorted({key for cells in evals.values() for key in cells})
    sets = list(dict.fromkeys(s for s, _ in keys))
    ks = sorted({k for _, k in keys})
    head = ["trainer", *[f"{s} k={k}" for s in sets for k in ks], "train s", "peak RSS GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys([*evals, *times]):
        cells = evals.get(name, {})
        row = [name]
        for s in sets:
            for k in ks:
                cell = cells.get((s, k))
                mark = "" if cell is None or cell["identical"] else " (outputs differ)"
                row.append(f"{cell['tau']:.3f}{mark}" if cell else "-")
        t = times.get(name)
        rss = f"{t['peak_rss_bytes'] / 2**30:.2f}" if t and "peak_rss_bytes" in t else "-"
        row += [f"{t['train_s']:.0f}" if t else "-", rss]
        lines.append("| " + " | ".join(row) + " |")
    print("\n".join(lines))
    report = {
        "evals": {n: {f"{s}/k={k}": v for (s, k), v in c.items()} for n, c in evals.items()},
        "times": times,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
