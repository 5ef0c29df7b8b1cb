"""Draft vocabulary: the K most frequent assistant tokens and vLLM's ``d2t`` / ``t2d`` tensors.

Definitions (docs/architecture.md, "On disk", Vocab; vLLM ``LlamaForCausalLMEagle3``):

* the chosen target ids are the top-K ids by frequency among supervised (``loss_mask == 1``)
  tokens, ties broken by the smaller id, then **sorted ascending**;
* when fewer than K distinct ids occur, the rest are the smallest unused ids (frequency 0), so the
  draft head always has exactly K rows;
* ``d2t[i] = chosen[i] - i`` (int64 **offsets**: ``target_id = draft_id + d2t[draft_id]``);
* ``t2d[j] = j in chosen`` (bool over the target vocabulary; ``t2d.sum() == K``).

Coverage is the share of assistant-token occurrences whose id is in the draft vocabulary: the
ceiling on how often the draft can even propose the verifier's next token. It is measured on the
training data, where it is near 100 % by construction; ``outside_share`` is its complement on what the
verifier generates for other prompts (``eagle3 eval`` reports it per prompt set): a token outside the
vocabulary ends every draft chain that reaches it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol import iter_prepared, read_meta

VOCAB_FILE = "vocab.safetensors"
VOCAB_STATS_FILE = "vocab.json"
_REPORT_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)
_FLUSH_TOKENS = 1 << 20


class VocabError(Eagle3Error, ValueError):
    """The requested draft vocabulary cannot be built (bad size, no assistant tokens)."""


@dataclass(frozen=True)
class DraftVocab:
    d2t: np.ndarray  # (K,) int64 offsets
    t2d: np.ndarray  # (V,) bool

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def target_ids(self) -> np.ndarray:
        """(K,) int64: target id of each draft id."""
        ids: np.ndarray = np.arange(self.draft_vocab_size, dtype=np.int64) + self.d2t
        return ids


@dataclass(frozen=True)
class VocabStats:
    draft_vocab_size: int
    target_vocab_size: int
    assistant_token_occurrences: int
    distinct_assistant_tokens: int
    padded_ids: int  # ids added with frequency 0 because fewer than K distinct tokens occurred
    coverage: float  # share of assistant-token occurrences inside the draft vocab
    coverage_at: dict[str, float] = field(default_factory=dict)  # the same for other sizes
    source: str = ""


def count_assistant_tokens(prepared_dir: str | Path) -> np.ndarray:
    """(V,) int64 occurrence counts of supervised token ids, streamed over the prepared samples."""
    meta = read_meta(prepared_dir)
    counts = np.zeros(meta.vocab_size, dtype=np.int64)
    pending_ids: list[int] = []
    pending_mask: list[int] = []
    for sample in iter_prepared(prepared_dir, vocab_size=meta.vocab_size):
        pending_ids += sample.input_ids
        pending_mask += sample.loss_mask
        if len(pending_ids) >= _FLUSH_TOKENS:
            counts += _count(pending_ids, pending_mask, meta.vocab_size)
            pending_ids.clear()
            pending_mask.clear()
    counts += _count(pending_ids, pending_mask, meta.vocab_size)
    return counts


def _count(ids: list[int], mask: list[int], vocab_size: int) -> np.ndarray:
    supervised = np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)]
    return np.bincount(supervised, minlength=vocab_size)


def select_ids(counts: np.ndarray, k: int) -> np.ndarray:
    """(K,) int64 ascending target ids: top-K by count (ties: smaller id), padded with unused ids."""
    ids = np.arange(counts.shape[0], dtype=np.int64)
    order = np.lexsort((ids, -counts))  # by count descending, then id ascending
    top = order[:k]
    chosen = top[counts[top] > 0]
    if chosen.shape[0] < k:
        unused = np.setdiff1d(ids, chosen, assume_unique=True)  # ascending
        chosen = np.concatenate([chosen, unused[: k - chosen.shape[0]]])
    return np.sort(chosen)


def coverage(counts: np.ndarray, target_ids: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[target_ids].sum()) / total if total else 0.0


def outside_share(token_ids: Iterable[Sequence[int]], target_ids: np.ndarray) -> float:
    """Share of the tokens in ``token_ids`` (per prompt, what the verifier generated) whose id is not one of
    ``target_ids`` (the draft vocabulary): tokens the draft can never propose. 0.0 when there are none."""
    tokens = np.fromiter((t for row in token_ids for t in row), dtype=np.int64)
    if tokens.size == 0:
        return 0.0
    return float(1.0 - np.isin(tokens, np.asarray(target_ids, dtype=np.int64)).mean())


def check_sizes(draft_vocab_size: int, target_vocab_size: int) -> None:
    if draft_vocab_size < 1:
        raise VocabError(f"draft vocab size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size > target_vocab_size:
        raise VocabError(
            f"draft vocab size {draft_vocab_size} is larger than the target vocabulary ({target_vocab_size} "
            f"tokens); use --draft-vocab-size {target_vocab_size} or less"
        )


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int, *, source: str = "") -> tuple[DraftVocab, VocabStats]:
    """Build ``d2t``/``t2d`` from assistant-token ``counts`` (shape (V,))."""
    counts = np.asarray(counts, dtype=np.int64)
    v, k = int(counts.shape[0]), int(draft_vocab_size)
    check_sizes(k, v)
    total = int(counts.sum())
    if total == 0:
        raise VocabError("no assistant tokens were found: the loss masks are all zero")
    chosen = select_ids(counts, k)  # (K,)
    d2t = chosen - np.arange(k, dtype=np.int64)  # (K,) offsets
    t2d = np.zeros(v, dtype=bool)  # (V,)
    t2d[chosen] = True
    distinct = int((counts > 0).sum())
    stats = VocabStats(
        draft_vocab_size=k,
        target_vocab_size=v,
        assistant_token_occurrences=total,
        distinct_assistant_tokens=distinct,
        padded_ids=max(0, k - distinct),
        coverage=coverage(counts, chosen),
        coverage_at=_coverage_by_size(counts, v),
        source=source,
    )
    return DraftVocab(d2t=d2t, t2d=t2d), stats


def _coverage_by_size(counts: np.ndarray, v: int) -> dict[str, float]:
    """Coverage of the top-n draft vocab for the report sizes: one sort, not one per size (padding
    ids have count 0, so the top-n counts alone give the coverage)."""
    cumulative = np.cumsum(np.sort(counts)[::-1])  # (V,)
    total = int(cumulative[-1])
    return {str(n): float(cumulative[n - 1]) / total for n in _REPORT_SIZES if n <= v}


def save_vocab(vocab: DraftVocab, stats: VocabStats, counts: np.ndarray, out_dir: str | Path) -> Path:
    """Write ``vocab.safetensors`` (d2t, t2d, token_counts) and ``vocab.json``; return the dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (VOCAB_FILE + ".partial")
    save_file(
        {"d2t": vocab.d2t, "t2d": vocab.t2d, "token_counts": counts.astype(np.int64)},
        str(tmp),
        metadata={
            "draft_vocab_size": str(vocab.draft_vocab_size),
            "target_vocab_size": str(vocab.target_vocab_size),
        },
    )
    tmp.replace(out / VOCAB_FILE)
    (out / VOCAB_STATS_FILE).write_text(json.dumps(asdict(stats), indent=2) + "\n")
    return out


def load_vocab(vocab_dir: str | Path) -> DraftVocab:
    tensors = load_file(str(Path(vocab_dir) / VOCAB_FILE))
    vocab = DraftVocab(d2t=tensors["d2t"].astype(np.int64), t2d=tensors["t2d"].astype(bool))
    if int(vocab.t2d.sum()) != vocab.draft_vocab_size:
        raise VocabError(f"{vocab_dir}: t2d marks {int(vocab.t2d.sum())} ids, d2t has {vocab.draft_vocab_size}")
    return vocab


def make_vocab(prepared_dir: str | Path, out_dir: str | Path, draft_vocab_size: int) -> VocabStats:
    """Count, select and save: the whole ``eagle3 vocab`` step."""
    target_vocab_size = read_meta(prepared_dir).vocab_size
    check_sizes(draft_vocab_size, target_vocab_size)  # before reading the data
    counts = count_assistant_tokens(prepared_dir)
    vocab, stats = build_draft_vocab(counts, draft_vocab_size, source=str(prepared_dir))
    save_vocab(vocab, stats, counts, out_dir)
    return stats
