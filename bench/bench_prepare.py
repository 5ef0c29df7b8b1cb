"""Benchmark ``eagle3 prepare`` on the builtin chatterbot dialogs with SmolLM2's tokenizer.

Prints one JSON object:
* ``mask_methods``: conversations/s and tokens/s of the two render-boundary implementations,
  measured side by side on the same conversations (offset mapping, one tokenization per
  conversation, vs the slow-tokenizer fallback that tokenizes every render), and their ratio;
* ``prepare``: end-to-end rows/s and tokens/s of ``prepare_dataset`` (read, parse, render, tokenize,
  write) and the peak traced Python heap for 1x and 4x the input (flat = streaming; measured in a
  separate pass because tracing slows Python);
* ``workers``: wall time of prepare on 48x the input with 1 and with 2 tokenizing processes
  (process start-up included), and the speed-up.

usage: python bench/bench_prepare.py [--multi-turn 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from eagle3.client.prepare import PrepareConfig, load_tokenizer, prepare_dataset
from eagle3.core.conversations import Conversation, Message, iter_rows, parse_row
from eagle3.core.masking import ChatTokenizer
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir


def conversations(multi_turn: int) -> list[Conversation]:
    """chatterbot dialogs, ``multi_turn`` of them chained into one conversation."""
    base = [parse_row(r.row or {}, r.location) for r in iter_rows("builtin:chatterbot")]
    out = []
    for i in range(0, len(base) - multi_turn + 1, multi_turn):
        msgs: list[Message] = [m for c in base[i : i + multi_turn] for m in c.messages]
        out.append(Conversation(base[i].location, tuple(msgs)))
    return out


def time_masking(chat: ChatTokenizer, convs: list[Conversation], use_offsets: bool) -> dict[str, float]:
    chat.use_offsets = use_offsets
    started, n_tokens = time.perf_counter(), 0
    for conv in convs:
        n_tokens += len(chat.tokenize(conv.messages).input_ids)
    elapsed = time.perf_counter() - started
    return {
        "seconds": round(elapsed, 3),
        "conversations_per_s": round(len(convs) / elapsed, 1),
        "tokens_per_s": round(n_tokens / elapsed, 1),
    }


def write_input(convs: list[Conversation], copies: int, work: Path) -> Path:
    src = work / f"in-{copies}.jsonl"
    with open(src, "w") as fh:
        for _ in range(copies):
            for conv in convs:
                fh.write(json.dumps({"messages": [m.as_dict() for m in conv.messages]}) + "\n")
    return src


def time_workers(tokenizer: Any, src: Path, workers: int, work: Path) -> dict[str, float]:
    """Wall time of one prepare run with ``workers`` processes (start-up included)."""
    started = time.perf_counter()
    stats = prepare_dataset(
        str(src),
        work / f"out-w{workers}",
        model=DEFAULT_MODEL,
        tokenizer=tokenizer,
        config=PrepareConfig(workers=workers, overwrite=True),
    )
    elapsed = time.perf_counter() - started
    return {"workers": workers, "seconds": round(elapsed, 3), "tokens_per_s": round(stats.total_tokens / elapsed, 1)}


def time_prepare(tokenizer: Any, convs: list[Conversation], copies: int, work: Path) -> dict[str, float]:
    src = write_input(convs, copies, work)
    started = time.perf_counter()
    stats = prepare_dataset(
        str(src), work / f"out-{copies}", model=DEFAULT_MODEL, tokenizer=tokenizer, config=PrepareConfig()
    )
    elapsed = time.perf_counter() - started
    tracemalloc.start()  # a second, traced pass: tracing slows Python several-fold, so it is not timed
    prepare_dataset(
        str(src), work / f"out-{copies}", model=DEFAULT_MODEL, tokenizer=tokenizer, config=PrepareConfig(overwrite=True)
    )
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "rows": stats.rows_read,
        "tokens": stats.total_tokens,
        "seconds": round(elapsed, 3),
        "rows_per_s": round(stats.rows_read / elapsed, 1),
        "tokens_per_s": round(stats.total_tokens / elapsed, 1),
        "peak_traced_mib": round(peak / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--multi-turn", type=int, default=4, help="dialogs chained per conversation")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds of the two mask methods")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL))
    chat = ChatTokenizer(tokenizer)
    convs = conversations(args.multi_turn)
    rounds: dict[str, list[dict[str, float]]] = {"offsets": [], "token_prefix": []}
    for _ in range(args.repeat):  # interleaved, so machine noise hits both alike
        rounds["offsets"].append(time_masking(chat, convs, True))
        rounds["token_prefix"].append(time_masking(chat, convs, False))
    best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in rounds.items()}
    with tempfile.TemporaryDirectory() as tmp:
        small = time_prepare(tokenizer, convs, 1, Path(tmp))
        large = time_prepare(tokenizer, convs, 4, Path(tmp))
        src = write_input(convs, 48, Path(tmp))
        one, two = time_workers(tokenizer, src, 1, Path(tmp)), time_workers(tokenizer, src, 2, Path(tmp))
    print(
        json.dumps(
            {
                "model": DEFAULT_MODEL,
                "conversations": len(convs),
                "turns_per_conversation": 2 * args.multi_turn,
                "mask_methods": {
                    "best_of": args.repeat,
                    **best,
                    "offsets_over_token_prefix": round(
                        best["offsets"]["tokens_per_s"] / best["token_prefix"]["tokens_per_s"], 2
                    ),
                },
                "workers": {
                    "rows": 48 * len(convs),
                    "1": one,
                    "2": two,
                    "speedup_2_over_1": round(one["seconds"] / two["seconds"], 2),
                    "cpu_count": os.cpu_count(),
                },
                "prepare": {
                    "1x": small,
                    "4x": large,
                    "peak_heap_ratio_4x_over_1x": round(large["peak_traced_mib"] / small["peak_traced_mib"], 2),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
