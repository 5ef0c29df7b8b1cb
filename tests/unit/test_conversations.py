from __future__ import annotations

import gzip
import json

import pytest

from eagle3.core.conversations import Message, RowError, SourceError, iter_rows, parse_row
from tests.conftest import write_jsonl


def test_openai_messages_with_system_and_content_parts():
    row = {
        "id": 7,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."},
        ],
    }
    conv = parse_row(row, "f.jsonl:3")
    assert conv.messages == (
        Message("system", "Be brief."),
        Message("user", "Hi there"),
        Message("assistant", "Hello."),
    )
    assert conv.source_id == "7"
    assert conv.location == "f.jsonl:3"


def test_sharegpt_roles_are_mapped():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
            {"from": "user", "value": "Q2"},
            {"from": "chatgpt", "value": "A2"},
        ]
    }
    roles = [m.role for m in parse_row(row, "x").messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_prompt_response_pair_with_system_and_completion_alias():
    conv = parse_row({"system": "S", "prompt": "P", "completion": "C"}, "x")
    assert conv.messages == (Message("system", "S"), Message("user", "P"), Message("assistant", "C"))


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"text": "hello"}, "unrecognized row shape (keys: text)"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role is 'robot'"),
        ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be a string, got int"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text content parts"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "conversations[0].from is 'alien'"),
        ({"prompt": "P"}, "no 'response'"),
    ],
)
def test_malformed_rows_say_why(row, needle):
    with pytest.raises(RowError) as info:
        parse_row(row, "x")
    assert needle in str(info.value)


def test_jsonl_rows_carry_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "a", "response": "b"},
            "",  # blank lines are skipped but still counted for line numbers
            "{not json",
            "[1, 2]",
            {"prompt": "c", "response": "d"},
        ],
    )
    rows = list(iter_rows(str(path)))
    assert [(r.location, r.key) for r in rows] == [
        (f"{path}:1", "line1"),
        (f"{path}:3", "line3"),
        (f"{path}:4", "line4"),
        (f"{path}:5", "line5"),
    ]
    assert rows[0].row == {"prompt": "a", "response": "b"} and rows[0].error is None
    assert rows[1].row is None and "invalid JSON" in (rows[1].error or "")
    assert "expected a JSON object, got list" in (rows[2].error or "")


def test_gzip_jsonl(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    assert [r.row for r in iter_rows(str(path))] == [{"prompt": "a", "response": "b"}]


def test_missing_input_and_plain_directory(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        list(iter_rows(str(tmp_path / "nope.jsonl")))
    with pytest.raises(SourceError, match="not a dataset saved with"):
        list(iter_rows(str(tmp_path)))


def test_builtin_chatterbot_alternates_roles_and_ends_on_assistant():
    rows = list(iter_rows("builtin:chatterbot"))
    assert 2000 <= len(rows) <= 2100  # chatterbot-corpus 1.3.3 ships 2,026 English dialogs
    assert len({r.key for r in rows}) == len(rows)
    for raw in rows:
        conv = parse_row(raw.row or {}, raw.location)
        roles = [m.role for m in conv.messages]
        assert roles[::2] == ["user"] * len(roles[::2])
        assert roles[1::2] == ["assistant"] * len(roles[1::2])
        assert roles[-1] == "assistant"


def test_a_bad_utf8_line_costs_only_that_line(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "a", "response": "b"}).encode()
    path.write_bytes(good + b"\n" + b'{"prompt": "\xff"}\n' + good + b"\n")
    rows = list(iter_rows(str(path)))
    assert [r.location for r in rows] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert rows[1].row is None and "not UTF-8 text (invalid start byte at byte 12)" in (rows[1].error or "")
    assert rows[2].row == {"prompt": "a", "response": "b"}


def test_truncated_gzip_names_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for i in range(2000):
            fh.write(json.dumps({"prompt": f"q{i}", "response": "r" * 50}) + "\n")
    path.write_bytes(path.read_bytes()[:-400])  # as if the writer crashed
    with pytest.raises(SourceError, match=r"d\.jsonl\.gz: cannot read past line \d+"):
        list(iter_rows(str(path)))
