"""What a checkpoint is: its text config and the identity of its tokenizer.

Both sides check identity against these: prepare records ``tokenizer_sha256`` in ``meta.json``, the
server reports it on ``/v1/info``, and ``extract`` refuses a prepared directory whose hash differs.
Multimodal and MoE checkpoints nest the language model's settings under ``text_config``;
``model_config`` returns that part wherever it is, so layer counts and sizes are read one way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

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


def tokenizer_sha256(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
