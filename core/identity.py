"""What a checkpoint is: its text config, the identity of its tokenizer and of its weights.

Both sides check identity against these: prepare records ``tokenizer_sha256`` in ``meta.json``, the
server reports it on ``/v1/info``, and ``extract`` refuses a prepared directory whose hash differs.
Multimodal and MoE checkpoints nest the language model's settings under ``text_config``;
``model_config`` returns that part wherever it is, so layer counts and sizes are read one way.
``checkpoint_revision`` names the weights by content (the revision on ``/v1/info``, in the feature
cache's namespace and in a features directory's ``features.json``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from eagle3.core.file_digests import FileDigests

# Hashed first, in this order (the hash of a directory holding only these is what it always was).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def model_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return dict(config.get("text_config") or config)


# Also read by AutoTokenizer whatever the class: added tokens and the other chat-template forms.
_TOKENIZER_EXTRA_FILES = ("added_tokens.json", "chat_template.json")


def tokenizer_files(model_dir: Path) -> list[str]:
    """What ``AutoTokenizer.from_pretrained(model_dir)`` reads: the common files above, the vocabulary
    files the configured tokenizer class declares (``vocab_files_names``: ``spiece.model``,
    ``qwen.tiktoken``, ...), ``added_tokens.json``, ``chat_template.json`` and
    ``additional_chat_templates/*``; only those present, common ones first, the rest sorted."""
    names = list(_TOKENIZER_FILES)
    extra = set(_TOKENIZER_EXTRA_FILES) | set(_declared_vocab_files(model_dir))
    names += sorted(extra - set(names))
    templates = model_dir / "additional_chat_templates"
    if templates.is_dir():
        names += sorted(f"additional_chat_templates/{p.name}" for p in templates.iterdir() if p.is_file())
    return [name for name in names if (model_dir / name).is_file()]


def _declared_vocab_files(model_dir: Path) -> list[str]:
    """``vocab_files_names`` of the class named by ``tokenizer_config.json`` (transformers imported only
    here); nothing when there is no such class or transformers does not know it."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return []
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str):
        return []
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tokenizer_class_from_name(name)
    except Exception:  # noqa: BLE001 (an unknown or remote-code class: the common files still count)
        return []
    return [str(v) for v in dict(getattr(cls, "vocab_files_names", {}) or {}).values() if isinstance(v, str)]


def tokenizer_sha256(model_dir: Path) -> str:
    """sha256 over ``tokenizer_files(model_dir)``: name, NUL, bytes of each."""
    digest = hashlib.sha256()
    for name in tokenizer_files(model_dir):
        digest.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    return digest.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
REVISION_FORMAT = "content-v1"  # hashed first: a revision of this kind never equals one of names and sizes only


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files and their indexes, sorted by name."""
    return [p for p in sorted(model_dir.iterdir()) if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]


def checkpoint_revision(
    model_dir: Path, digests: FileDigests | None = None, stop: threading.Event | None = None
) -> str:
    """sha256 over config.json and each weight file's name, size and content digest
    (``core/file_digests.py``: xxh3-128 of its bytes, computed once per file and remembered in eagle3's
    cache directory, or the hub's own sha256 of a snapshot's blob). So a fine-tuned copy with the same
    file sizes has another revision, and a restart of an unchanged checkpoint reads no weight byte."""
    digests = digests or FileDigests()
    digest = hashlib.sha256(REVISION_FORMAT.encode() + b"\0" + (model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        content = digests.digest(path, stop)
        digest.update(f"\0{path.name}\0{path.stat().st_size}\0{content}".encode())
    return digest.hexdigest()
