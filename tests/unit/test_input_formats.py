"""prepare's inputs: the same conversations read from JSONL, a JSON array, parquet and a saved
``datasets`` directory give the same rows; an unknown file type is a clear error naming what is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.core.conversations import SourceError, iter_rows, parse_row
from tests.conftest import write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} ü"}]} for i in range(5)
] + [{"prompt": "p", "response": "r"}]


def conversations(source: Path) -> list[list[tuple[str, str]]]:
    out = []
    for row in iter_rows(str(source)):
        assert row.row is not None, row.error
        conv = parse_row(row.row, row.location)
        out.append([(m.role, m.content) for m in conv.messages])
    return out


def test_jsonl_json_array_parquet_and_saved_dataset_read_the_same(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import datasets
    import pyarrow as pa

    expected = conversations(write_jsonl(tmp_path / "in.jsonl", ROWS))
    assert len(expected) == len(ROWS)
    (tmp_path / "in.json").write_text(json.dumps(ROWS, ensure_ascii=False, indent=1))
    assert conversations(tmp_path / "in.json") == expected
    write_jsonl(tmp_path / "lines.json", ROWS)  # .json holding JSON lines also works
    assert conversations(tmp_path / "lines.json") == expected
    chat = [r for r in ROWS if "messages" in r]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "in.parquet", row_group_size=2)
    assert conversations(tmp_path / "in.parquet") == expected[: len(chat)]
    datasets.Dataset.from_list(chat).save_to_disk(str(tmp_path / "saved"))
    assert conversations(tmp_path / "saved") == expected[: len(chat)]
    rows = list(iter_rows(str(tmp_path / "in.json")))
    assert rows[2].location == f"{tmp_path / 'in.json'}[2]" and rows[2].key == "row3"


def test_unknown_types_and_bad_files_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "in.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match=r"unknown input type '\.csv'.*\.parquet"):
        list(iter_rows(str(tmp_path / "in.csv")))
    (tmp_path / "bad.json").write_text('[{"messages": []},\n {oops}]')
    with pytest.raises(SourceError, match=r"bad\.json:2: invalid JSON"):
        list(iter_rows(str(tmp_path / "bad.json")))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(SourceError, match="not a readable parquet file"):
        list(iter_rows(str(tmp_path / "bad.parquet")))
    (tmp_path / "mixed.json").write_text('[{"prompt": "p", "response": "r"}, 3]')
    rows = list(iter_rows(str(tmp_path / "mixed.json")))
    assert rows[1].error == "expected a JSON object, got int"


def test_prepare_passes_trust_remote_code_to_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``eagle3 prepare --trust-remote-code`` reaches AutoTokenizer (the default stays off)."""
    import transformers

    from eagle3.cli import main

    seen: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        seen.append(kwargs.get("trust_remote_code"))
        raise OSError("stop here: the tokenizer was requested")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 10, "max_position_embeddings": 64}')
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    base = ["prepare", "--input", str(src), "--model", str(model)]
    for extra, expected in (([], False), (["--trust-remote-code"], True)):
        assert main([*base, "--out", str(tmp_path / f"out{len(seen)}"), *extra]) == 1  # the one-line error
        assert seen[-1] is expected
