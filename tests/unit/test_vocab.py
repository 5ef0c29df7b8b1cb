from __future__ import annotations

import numpy as np
import pytest

from eagle3.draft_trainer.vocab import (
    DraftVocab,
    VocabError,
    build_draft_vocab,
    coverage,
    load_vocab,
    outside_share,
    save_vocab,
    select_ids,
)


def check_invariants(vocab: DraftVocab, chosen: np.ndarray) -> None:
    k = vocab.draft_vocab_size
    assert vocab.d2t.dtype == np.int64 and vocab.t2d.dtype == np.bool_
    assert np.array_equal(np.arange(k) + vocab.d2t, chosen)  # d2t is an offset
    assert np.all(np.diff(chosen) > 0)  # ascending, distinct
    assert int(vocab.t2d.sum()) == k
    assert np.array_equal(np.flatnonzero(vocab.t2d), chosen)


def test_top_k_by_frequency_sorted_ascending_with_offsets():
    counts = np.zeros(20, dtype=np.int64)
    counts[[17, 3, 9, 11, 5]] = [50, 40, 30, 20, 10]
    vocab, stats = build_draft_vocab(counts, 3)
    check_invariants(vocab, np.array([3, 9, 17]))
    assert vocab.d2t.tolist() == [3, 8, 15]
    assert stats.padded_ids == 0
    assert stats.distinct_assistant_tokens == 5
    assert stats.assistant_token_occurrences == 150
    assert stats.coverage == pytest.approx(120 / 150)


def test_ties_break_towards_smaller_id():
    counts = np.array([0, 5, 5, 5, 1], dtype=np.int64)
    assert select_ids(counts, 2).tolist() == [1, 2]


def test_padding_when_fewer_distinct_tokens_than_k():
    counts = np.zeros(10, dtype=np.int64)
    counts[[2, 7]] = [4, 1]
    vocab, stats = build_draft_vocab(counts, 5)
    chosen = np.array([0, 1, 2, 3, 7])  # 2 and 7 by frequency, then the smallest unused ids 0, 1, 3
    check_invariants(vocab, chosen)
    assert stats.padded_ids == 3
    assert stats.coverage == 1.0


def test_full_vocab_draft_is_identity():
    counts = np.arange(8, dtype=np.int64)
    vocab, stats = build_draft_vocab(counts, 8)
    assert vocab.d2t.tolist() == [0] * 8
    assert vocab.t2d.all()
    assert stats.coverage == 1.0


def test_coverage_at_other_sizes_matches_direct_computation():
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, size=5000).astype(np.int64)
    _, stats = build_draft_vocab(counts, 2048)
    assert stats.coverage_at["1024"] == pytest.approx(coverage(counts, select_ids(counts, 1024)))
    assert stats.coverage_at["1024"] < stats.coverage_at["2048"] == pytest.approx(stats.coverage)
    assert "32000" not in stats.coverage_at  # larger than this target vocab


@pytest.mark.parametrize(("k", "needle"), [(0, "must be >= 1"), (11, "larger than the target vocabulary")])
def test_bad_sizes(k, needle):
    with pytest.raises(VocabError, match=needle):
        build_draft_vocab(np.ones(10, dtype=np.int64), k)


def test_no_assistant_tokens_is_an_error():
    with pytest.raises(VocabError, match="no assistant tokens"):
        build_draft_vocab(np.zeros(10, dtype=np.int64), 4)


def test_save_and_load_round_trip(tmp_path):
    counts = np.array([0, 3, 0, 9, 1, 0], dtype=np.int64)
    vocab, stats = build_draft_vocab(counts, 3)
    save_vocab(vocab, stats, counts, tmp_path)
    loaded = load_vocab(tmp_path)
    assert loaded.d2t.dtype == np.int64 and loaded.t2d.dtype == np.bool_
    assert np.array_equal(loaded.d2t, vocab.d2t) and np.array_equal(loaded.t2d, vocab.t2d)
    assert loaded.target_ids.tolist() == [1, 3, 4]
    assert not list(tmp_path.glob("*.partial"))


def test_outside_share_counts_the_generated_tokens_the_vocabulary_lacks():
    target_ids = np.array([3, 7, 42])
    assert outside_share([[3, 7, 5], [42, 9]], target_ids) == pytest.approx(2 / 5)  # 5 and 9 are outside
    assert outside_share([[3], [7, 42]], target_ids) == 0.0
    assert outside_share([[], []], target_ids) == 0.0  # nothing generated: nothing outside
