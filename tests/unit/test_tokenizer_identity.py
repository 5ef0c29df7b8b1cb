"""The tokenizer identity covers what the tokenizer loads: a vocabulary file the tokenizer class
declares (``spiece.model`` for T5), ``added_tokens.json`` and extra chat templates change the hash;
weights and config do not; a directory with only the common files keeps the hash it always had."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from eagle3.core.identity import tokenizer_files, tokenizer_sha256

OLD_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
             "merges.txt", "chat_template.jinja")  # fmt: skip


def old_sha256(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in OLD_FILES:
        if (model_dir / name).is_file():
            digest.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    return digest.hexdigest()


def test_the_embedded_tokenizer_keeps_its_hash(smollm2_dir: Path) -> None:
    assert tokenizer_sha256(smollm2_dir) == old_sha256(smollm2_dir)  # prepared directories stay valid


def test_declared_and_extra_files_count(tmp_path: Path) -> None:
    d = tmp_path / "t5"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer"}))
    (d / "spiece.model").write_bytes(b"sentencepiece v1")
    (d / "config.json").write_text("{}")
    assert tokenizer_files(d) == ["tokenizer_config.json", "spiece.model"]
    before = tokenizer_sha256(d)
    (d / "spiece.model").write_bytes(b"sentencepiece v2")
    assert tokenizer_sha256(d) != before  # the old fixed list never read spiece.model
    after_vocab = tokenizer_sha256(d)
    (d / "added_tokens.json").write_text('{"<x>": 32100}')
    assert tokenizer_sha256(d) != after_vocab
    with_added = tokenizer_sha256(d)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert tokenizer_sha256(d) != with_added
    with_templates = tokenizer_sha256(d)
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(b"weights")
    assert tokenizer_sha256(d) == with_templates  # not tokenizer files


def test_an_unknown_tokenizer_class_still_hashes_the_common_files(tmp_path: Path, smollm2_dir: Path) -> None:
    d = tmp_path / "custom"
    shutil.copytree(smollm2_dir, d, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    assert "tokenizer.json" in tokenizer_files(d)
