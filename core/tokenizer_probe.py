"""Does a loaded tokenizer round-trip text? Checked at ``prepare`` and ``serve`` before any use.

A tokenizer can load without an error and still lose text: DeepSeek-V3's ``tokenizer_config.json``
names ``LlamaTokenizerFast`` for a byte-level BPE ``tokenizer.json``; beside a config of another model
type (or none) transformers 5.19 builds a sentencepiece-style ``LlamaTokenizer`` that drops spaces and
CJK ("Hello world, 你好！" -> the ids of "Helloworld,"; upstream transformers#45488). Every sample
prepared with it would be silently wrong.

``probe_tokenizer`` encodes ``PROBE_TEXT`` (spaces, tabs, digits, CJK, emoji, accents) and a chat
rendered with the tokenizer's own template (its special tokens included) and decodes them back; any
difference is a ``TokenizerProbeError`` that shows the first one and the fix: when the same files
loaded as the class their ``tokenizer.json`` describes (``PreTrainedTokenizerFast``) do round-trip,
the message says to set ``"tokenizer_class": "PreTrainedTokenizerFast"`` in ``tokenizer_config.json``.
The fix is an edit of that file, so ``core.identity.tokenizer_sha256`` (hence ``/v1/info``'s hash and
``meta.json``'s) covers it: the SDK and the server cannot disagree on which tokenizer is meant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.core.errors import Eagle3Error

PROBE_TEXT = "Hello world,  two  spaces\tand a tab\n3.14159 + 42 = 45.14159; 你好，世界！ emoji 🙂👍🏽 café naïve"
PROBE_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there, 你好 🙂"},
    {"role": "assistant", "content": "Hello! 2 + 2 = 4."},
    {"role": "user", "content": "Thanks."},
]
FAST_CLASS = "PreTrainedTokenizerFast"


class TokenizerProbeError(Eagle3Error, ValueError):
    """The tokenizer loses text on a round trip; the message names the fix."""


def round_trip_error(tokenizer: Any, text: str) -> str | None:
    """None when ``decode(encode(text)) == text`` (no special tokens added or skipped), else a short
    description of the first difference."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    back = str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    if back == text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, back, strict=False)) if a != b), min(len(text), len(back)))
    return f"{text[max(0, at - 12) : at + 24]!r} came back as {back[max(0, at - 12) : at + 24]!r}"


def _chat_text(tokenizer: Any) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return str(tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True))
    except Exception:  # noqa: BLE001 (a template that rejects a system turn: try without it)
        try:
            return str(tokenizer.apply_chat_template(PROBE_CHAT[1:], tokenize=False, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 (the template's own errors surface where it is used: core/masking.py)
            return None


def special_token_error(tokenizer: Any, text: str) -> str | None:
    """Each added (special) token of the vocabulary that occurs in ``text`` must encode as its one id."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for token, token_id in dict(tokenizer.get_added_vocab()).items():
        if token and token in text and int(token_id) not in ids:
            return f"the chat template's token {token!r} does not encode as its id {token_id}"
    return None


def probe_errors(tokenizer: Any) -> list[str]:
    """What the tokenizer gets wrong on the probe text and the probe chat (empty when nothing)."""
    errors = [e for e in (round_trip_error(tokenizer, PROBE_TEXT),) if e]
    chat = _chat_text(tokenizer)
    if chat is not None:
        errors += [e for e in (round_trip_error(tokenizer, chat), special_token_error(tokenizer, chat)) if e]
    return errors


def _fast_alternative_works(model_dir: Path) -> bool:
    """The files loaded as ``PreTrainedTokenizerFast`` (the class ``tokenizer.json`` describes) pass."""
    if not (model_dir / "tokenizer.json").is_file():
        return False
    try:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    except Exception:  # noqa: BLE001 (no alternative to suggest)
        return False
    return not probe_errors(fast)


def probe_tokenizer(tokenizer: Any, model_dir: Path) -> None:
    """Raise ``TokenizerProbeError`` when ``tokenizer`` (loaded from ``model_dir``) does not round-trip
    the probe (module docstring); the message names the class loaded, the one configured and the fix."""
    errors = probe_errors(tokenizer)
    if not errors:
        return
    configured = _configured_class(model_dir)
    loaded = type(tokenizer).__name__
    head = (
        f"the tokenizer of {model_dir} ({loaded}, tokenizer_config.json names {configured or 'no class'}) "
        f"does not round-trip text: {'; '.join(errors)}."
    )
    if _fast_alternative_works(model_dir):
        fix = (
            f' Fix: set "tokenizer_class": "{FAST_CLASS}" in {model_dir / "tokenizer_config.json"} '
            f"(its tokenizer.json loaded as {FAST_CLASS} round-trips; transformers#45488), then rerun"
        )
    else:
        fix = (
            " Fix: use the tokenizer files the model was trained with, or name the right class in "
            "tokenizer_config.json's tokenizer_class (trust_remote_code for a custom one)"
        )
    raise TokenizerProbeError(head + fix)


def _configured_class(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return str(name) if name else None
