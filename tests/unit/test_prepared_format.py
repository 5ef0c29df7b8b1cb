from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.core.protocol import PreparedFormatError, PreparedMeta, PreparedSample, iter_prepared, read_meta

META = PreparedMeta(
    model="m",
    model_dir="/m",
    tokenizer_sha256="0" * 64,
    chat_template_sha256="1" * 64,
    vocab_size=100,
    max_length=64,
    overlong="drop",
    inputs=["in.jsonl"],
)


def write_prepared(tmp_path: Path, lines: list[str]) -> Path:
    (tmp_path / "meta.json").write_text(META.to_json())
    (tmp_path / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    return tmp_path


def test_round_trip(tmp_path):
    sample = PreparedSample("line1", [5, 6, 7], [0, 1, 1], "in.jsonl:1")
    write_prepared(tmp_path, [sample.to_json()])
    assert list(iter_prepared(tmp_path, vocab_size=100)) == [sample]
    assert read_meta(tmp_path) == META
    assert sample.n_tokens == 3 and sample.n_assistant_tokens == 2


@pytest.mark.parametrize(
    ("ids", "mask", "needle"),
    [
        ([], [], "input_ids is empty"),
        ([1, 2], [1], "2 input_ids but 1 loss_mask"),
        ([1, 2], [0, 0], "no assistant token"),
        ([1, 2], [1, 2], "values other than 0/1"),
    ],
)
def test_sample_invariants(ids, mask, needle):
    with pytest.raises(PreparedFormatError, match=needle):
        PreparedSample("s", ids, mask)


def test_bad_lines_are_named_by_file_and_line(tmp_path):
    good = PreparedSample("a", [1], [1]).to_json()
    write_prepared(tmp_path, [good, json.dumps({"id": "b", "input_ids": [1]})])
    with pytest.raises(PreparedFormatError, match=r"samples\.jsonl:2: missing key 'loss_mask'"):
        list(iter_prepared(tmp_path))


def test_token_ids_outside_the_vocab(tmp_path):
    write_prepared(tmp_path, [PreparedSample("a", [1, 100], [0, 1]).to_json()])
    with pytest.raises(
        PreparedFormatError, match=r"samples\.jsonl:1: token id 100 is outside the vocabulary \[0, 100\)"
    ):
        list(iter_prepared(tmp_path, vocab_size=100))


def test_schema_version_mismatch(tmp_path):
    write_prepared(tmp_path, [])
    meta = json.loads((tmp_path / "meta.json").read_text())
    meta["schema_version"] = 99
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(PreparedFormatError, match="schema_version 99; this eagle3 reads 1"):
        read_meta(tmp_path)


def test_write_prepared_and_concat(tmp_path):
    from eagle3.core.protocol.prepared import concat_prepared, write_prepared

    first = [PreparedSample("a", [1, 2, 3], [0, 1, 1]), PreparedSample("b", [4, 5], [0, 1])]
    assert write_prepared(tmp_path / "one", first, META, {"source": "test"}) == 2
    assert list(iter_prepared(tmp_path / "one")) == first
    assert read_meta(tmp_path / "one").max_length == 3  # the longest sample, whatever META said
    assert json.loads((tmp_path / "one" / "stats.json").read_text()) == {"samples_kept": 2, "source": "test"}
    second = [PreparedSample("c", [6, 7, 8, 9], [0, 0, 1, 1])]
    write_prepared(tmp_path / "two", second, META, {})
    assert concat_prepared([tmp_path / "one", tmp_path / "two"], tmp_path / "both") == 3
    assert list(iter_prepared(tmp_path / "both")) == first + second
    assert read_meta(tmp_path / "both").max_length == 4
    assert read_meta(tmp_path / "both").inputs == ["in.jsonl", "in.jsonl"]


def test_write_prepared_refuses_a_repeated_id_and_leaves_no_file(tmp_path):
    from eagle3.core.protocol.prepared import concat_prepared, write_prepared

    sample = PreparedSample("a", [1, 2], [0, 1])
    with pytest.raises(PreparedFormatError, match="'a' appears twice"):
        write_prepared(tmp_path / "dup", [sample, sample], META, {})
    assert sorted(p.name for p in (tmp_path / "dup").iterdir()) == []  # no samples, partial, meta or stats
    write_prepared(tmp_path / "one", [sample], META, {})
    with pytest.raises(PreparedFormatError, match="appears twice"):
        concat_prepared([tmp_path / "one", tmp_path / "one"], tmp_path / "both")
    assert not (tmp_path / "both" / "samples.jsonl").exists()
