"""``bench/tau_by_context.py``'s bookkeeping: a round's first draft sits after the prompt, the verifier's first
token, and every earlier round's accepted drafts plus its verifier token (``speculate.py``'s commit order)."""

from __future__ import annotations

from bench.tau_by_context import bucket_of, rounds_by_position


def test_buckets_are_half_open_ranges() -> None:
    assert [bucket_of(p, [100, 150]) for p in (0, 99, 100, 149, 150, 900)] == [
        "0-99", "0-99", "100-149", "100-149", "150+", "150+",
    ]  # fmt: skip


def test_round_positions_follow_the_commits() -> None:
    # prompt of 10 tokens: the verifier's first token is row 10, round 1 drafts from row 11; it accepts 2, so
    # rows 11-12 are its drafts and row 13 the verifier's token: round 2 drafts from row 14, accepts 0 (its
    # row 14 is the verifier's), round 3 from row 15
    assert rounds_by_position(10, [2, 0, 4], [13, 15]) == [("0-12", 2), ("13-14", 0), ("15+", 4)]
