"""Built-in evaluation prompt sets: MT-Bench's first turns, the field's own benchmark for τ.

MT-Bench's 80 questions (FastChat, Apache-2.0; ``core/data/NOTICE``) are the prompts published EAGLE-3
figures are measured on (chain drafting, greedy, the first turn of each question). They are an
*evaluation* set: a dataset that contains one of them (or a prompt derived from one) would measure
memorisation, so ``overlapping_prompts`` finds such prompts by the same normalised text the
self-instruct dedupe uses.

Stdlib only; rendering with the verifier's chat template takes its (transformers) tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

MT_BENCH = "mt-bench"
PROMPT_SETS = (MT_BENCH,)
MT_BENCH_FILE = "mt_bench_question.jsonl"
MT_BENCH_SIZE = 80
MIN_CONTAINED_WORDS = 8


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str  # "mt-bench/81"
    category: str
    text: str  # the user turn


def normalize(text: str) -> str:
    """Lower case, letters and digits only, single spaces: the key two prompts are compared by."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def mt_bench_first_turns() -> list[BenchPrompt]:
    """MT-Bench's 80 first turns, in question order."""
    text = resources.files("eagle3.core").joinpath("data", MT_BENCH_FILE).read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = [BenchPrompt(f"{MT_BENCH}/{r['question_id']}", str(r["category"]), str(r["turns"][0])) for r in rows]
    if len(prompts) != MT_BENCH_SIZE:
        raise RuntimeError(f"{MT_BENCH_FILE}: {len(prompts)} questions, expected {MT_BENCH_SIZE} (damaged install)")
    return prompts


def prompt_set(name: str) -> list[BenchPrompt]:
    """A built-in prompt set by name (``PROMPT_SETS``)."""
    if name == MT_BENCH:
        return mt_bench_first_turns()
    raise ValueError(f"unknown prompt set {name!r}; built in: {', '.join(PROMPT_SETS)}")


def render_user_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt ids of one user turn with the generation prompt, rendered by the verifier's chat template
    and tokenized as ``eagle3 prepare`` tokenizes a conversation (no extra special tokens)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(str(rendered), add_special_tokens=False)["input_ids"])


def overlapping_prompts(texts: Iterable[str], bench: Iterable[BenchPrompt] | None = None) -> list[tuple[str, str]]:
    """``(text, prompt_id)`` for every text equal to a benchmark prompt, or containing one (or
    contained in one) after ``normalize``. Containment counts only when the shorter side has at least
    ``MIN_CONTAINED_WORDS`` words: a shared phrase ("lord of the rings") is not a shared question."""
    keys = [(normalize(p.text), p.prompt_id) for p in (mt_bench_first_turns() if bench is None else bench)]
    hits: list[tuple[str, str]] = []
    for text in texts:
        key = normalize(text)
        if not key:
            continue
        for bench_key, prompt_id in keys:
            shorter = min(len(key.split()), len(bench_key.split()))
            contained = shorter >= MIN_CONTAINED_WORDS and (key in bench_key or bench_key in key)
            if key == bench_key or contained:
                hits.append((text, prompt_id))
                break
    return hits
