"""Reading prompts: an instruction about a passage, the passage being a reply the verifier already wrote.

    texts = reading_prompts(passages(tokenizer, "distilled", 0.05), ReadingConfig(n_prompts=1000))
    write_prompt_dir(texts, "rd-prompts", tokenizer, read_meta("distilled"), id_prefix="rd")

Why: the 10-epoch draft's τ per MT-Bench category was lowest on *extraction* (1.38) and *writing* (1.50)
and highest on roleplay, math and coding (1.78 / 1.77 / 1.75; docs/draft-quality.md, "The 3,640 prompts at
10 epochs"): the categories whose prompts hand the model a passage to read, summarise or rewrite. The
self-instruct prompts (``client/self_instruct.py``) are at most a few dozen tokens and never hold a
passage, so the draft never learns the verifier's replies that reuse the words of its prompt. These
prompts do: each pairs an instruction from ``INSTRUCTIONS`` (summarise, list, rewrite, title, explain,
continue; written for this purpose, not taken from any evaluation set) with a passage, and ``eagle3
distill`` then has the verifier answer them.

Passages are the training split's replies of a distilled dataset (the supervised tokens of each first
reply; extra sampled replies repeat a prompt and are skipped), cut at the last sentence end within
``max_passage_tokens`` and kept from ``min_passage_tokens``: no held-out reply lends a passage, so the
held-out split stays unseen, and nothing is generated here (no server: ``eagle3 distill`` is the one
verifier call). A passage is used once; the instruction comes before or after it (both forms are common
in real prompts), drawn with ``seed``. No kept prompt overlaps an MT-Bench question
(``core.prompt_sets.overlapping_prompts``).

Invariants (tests/unit/test_reading_prompts.py): the same data, config and seed give the same prompts;
every prompt holds one training-split passage whole and one instruction; no held-out reply appears.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.prompt_sets import mt_bench_first_turns, normalize, overlapping_prompts
from eagle3.core.protocol.prepared import is_heldout, iter_prepared, variant_of

INSTRUCTIONS = (
    "Summarize this text in two sentences.",
    "List the main points of this text as bullet points.",
    "Rewrite this text in simpler words.",
    "Rewrite this text in a more formal tone.",
    "What is the main idea of this text?",
    "Give this text a short title and explain your choice.",
    "Which facts does this text state? List each one.",
    "Shorten this text to about half its length.",
    "Explain this text to a ten-year-old.",
    "Write three questions that this text answers, and answer them.",
    "Correct any mistakes in this text and return the corrected version.",
    "Write a short reply to the author of this text.",
    "Continue this text with one more paragraph.",
    "Pick the three most important words in this text and explain why each matters.",
)
SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


@dataclass(frozen=True)
class ReadingConfig:
    n_prompts: int = 1000
    min_passage_tokens: int = 40
    max_passage_tokens: int = 160
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts must be >= 1, got {self.n_prompts}")
        if not 1 <= self.min_passage_tokens <= self.max_passage_tokens:
            raise ValueError(
                f"need 1 <= min_passage_tokens <= max_passage_tokens, got "
                f"{self.min_passage_tokens} and {self.max_passage_tokens}"
            )


def cut_passage(text: str, tokenizer: Any, min_tokens: int, max_tokens: int) -> str | None:
    """``text`` up to its last sentence end (or line end) within ``max_tokens`` tokens, or None when that
    leaves fewer than ``min_tokens``. A distilled reply that hit its token limit stops mid-sentence: that
    tail goes too, so a passage never ends in a cut word."""
    text = text.strip()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        text = str(tokenizer.decode(ids[:max_tokens])).strip()
    if not text.endswith((".", "!", "?")):
        ends = [m.end() for m in SENTENCE_END.finditer(text)]
        text = text[: ends[-1]].strip() if ends else ""
    if len(tokenizer(text, add_special_tokens=False)["input_ids"]) < min_tokens:
        return None
    return text


def passages(tokenizer: Any, prepared_dir: str | Path, heldout_fraction: float, config: ReadingConfig) -> list[str]:
    """The training split's first replies of ``prepared_dir`` (a distilled dataset), cut to passages
    (``cut_passage``), distinct after ``normalize``, in the dataset's order."""
    out: list[str] = []
    seen: set[str] = set()
    for sample in iter_prepared(prepared_dir):
        if variant_of(sample.sample_id)[1] or is_heldout(sample.sample_id, heldout_fraction):
            continue  # an extra sampled reply, or a held-out one
        reply = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
        text = str(tokenizer.decode(reply, skip_special_tokens=True))
        passage = cut_passage(text, tokenizer, config.min_passage_tokens, config.max_passage_tokens)
        if passage is None or normalize(passage) in seen:
            continue
        seen.add(normalize(passage))
        out.append(passage)
    return out


def reading_prompts(
    texts: Iterable[str], config: ReadingConfig, instructions: tuple[str, ...] = INSTRUCTIONS
) -> list[str]:
    """Up to ``config.n_prompts`` prompts, each one passage of ``texts`` (shuffled with ``seed``, each used
    once) with an instruction before or after it; none overlapping an MT-Bench question."""
    draw = random.Random(config.seed)  # noqa: S311 (a reproducible draw, not a secret)
    pool = list(texts)
    draw.shuffle(pool)
    bench = mt_bench_first_turns()
    kept: list[str] = []
    for passage in pool:
        instruction = draw.choice(instructions)
        prompt = f"{instruction}\n\n{passage}" if draw.random() < 0.5 else f"{passage}\n\n{instruction}"
        if not overlapping_prompts([prompt], bench):
            kept.append(prompt)
        if len(kept) == config.n_prompts:
            break
    return kept
