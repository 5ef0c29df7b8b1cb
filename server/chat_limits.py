"""Bounds on chat ``messages`` input, checked before any template is rendered or text tokenized.

Rendering a conversation for its loss mask costs O(assistant turns x characters) (core/masking.py
renders each prefix once), so an unchecked request of thousands of short turns cost a minute of CPU
before its length check said 400. These bounds refuse, in O(messages), only what cannot fit the token
cap anyway:

* ``max_chars``: no token of the vocabulary spells more than ``longest_token_chars`` characters, so a
  sample of more than ``max_model_len x longest_token_chars`` characters of content has more than
  ``max_model_len`` tokens (and a request, more than its token cap x that);
* ``max_messages``: the template adds at least ``min_tokens_per_message`` tokens per message
  (measured on empty messages at load, minus one for a merge with the content), so more than
  ``max_model_len // that`` messages cannot fit. A template that adds none gets ``max_model_len``:
  each message must then bring a token of its own content.

Within the bounds the worst case is ``max_messages / 2`` renders of ``max_chars``: measured in
docs/reliability.md. Tokenization runs in ``TokenizerPool`` (server/runtime.py), never on the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagle3.core.conversations import Message
from eagle3.core.masking import ChatTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatLimits:
    max_messages: int  # per sample
    max_chars: int  # content characters per sample
    longest_token_chars: int

    def request_chars(self, max_request_tokens: int) -> int:
        """Content characters one request may carry in all (its token cap, spelled out)."""
        return max_request_tokens * self.longest_token_chars


def longest_token_chars(chat: ChatTokenizer) -> int:
    """Characters of the longest token string in the vocabulary (byte-level BPE: bytes, >= characters)."""
    vocab = chat.tokenizer.get_vocab()
    return max(1, max((len(token) for token in vocab), default=1))


def min_tokens_per_message(chat: ChatTokenizer) -> int:
    """The fewest tokens the template adds for one more (empty) message, over user and assistant turns."""
    convo = [Message("user", ""), Message("assistant", ""), Message("user", ""), Message("assistant", "")]
    counts = []
    for n in range(1, len(convo) + 1):
        text = chat.render(convo[:n], add_generation_prompt=False)
        counts.append(len(chat.tokenizer(text, add_special_tokens=False)["input_ids"]))
    fewest = min(b - a for a, b in zip(counts, counts[1:], strict=False))
    return max(0, fewest - 1)  # minus one: real content may merge with the markup into one token


def chat_limits(chat: ChatTokenizer, max_model_len: int) -> ChatLimits:
    longest = longest_token_chars(chat)
    try:
        per_message = min_tokens_per_message(chat)
    except Exception as exc:  # noqa: BLE001 (a template that refuses empty turns: fall back to the safe bound)
        logger.info("chat limits: template refused empty messages (%s); one token per message assumed", exc)
        per_message = 0
    max_messages = max_model_len // per_message if per_message else max_model_len
    limits = ChatLimits(
        max_messages=max(1, max_messages), max_chars=max_model_len * longest, longest_token_chars=longest
    )
    logger.info(
        "chat limits: %d messages and %d characters per sample (template adds >= %d tokens per message, "
        "longest token %d characters)",
        limits.max_messages,
        limits.max_chars,
        per_message,
        longest,
    )
    return limits
