"""Tokenize a conversation with the verifier's chat template; loss mask by render boundary.

For each assistant message ``j`` the conversation is rendered twice: ``messages[:j]`` with the
generation prompt, and ``messages[:j+1]`` without it. The characters the second render adds past the
first are the assistant turn exactly as the template writes it, end-of-turn token included; the
tokens of the full render that overlap those characters are supervised (``loss_mask == 1``).

This needs no knowledge of the template's markup, so it works for ChatML, Llama-3 headers,
Mistral ``[INST]`` and any other shape, provided the template is *prefix-stable*: rendering a
conversation prefix yields a prefix of rendering the whole conversation. Templates that rewrite
earlier turns (e.g. dropping past reasoning) are not, and are rejected with ``TemplateError``
instead of producing a wrong mask. So is a template that renders an assistant turn as nothing:
the mask is never silently all-zero, and never falls back to all-ones.

Boundary tokens: a token that straddles the start of a turn (BPE merging the generation prompt's
last character with the reply's first, e.g. ``"\n"`` + ``" "`` -> ``"\n "``) carries assistant text,
so it is supervised; this happens only for replies that begin with whitespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3.core.conversations import Message, RowError
from eagle3.core.errors import Eagle3Error


class TemplateError(Eagle3Error, ValueError):
    """The chat template cannot yield a correct loss mask; fatal for the whole dataset."""


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]


class ChatTokenizer:
    """Wraps a Hugging Face tokenizer; ``chat_template`` overrides the tokenizer's own."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise TemplateError("the tokenizer has no chat template; pass one with --chat-template FILE")
        self.use_offsets = bool(getattr(tokenizer, "is_fast", False))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [m.as_dict() for m in messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:
            raise RowError(f"chat template rejected the conversation: {exc}") from exc
        return str(text)

    def tokenize(self, messages: Sequence[Message]) -> Tokenized:
        """Token ids of the whole conversation and its assistant-token mask."""
        full = self.render(messages, add_generation_prompt=False)
        turns = self._assistant_renders(messages, full)
        if self.use_offsets:
            return self._mask_by_offsets(full, [(len(before), len(after)) for before, after in turns])
        return self._mask_by_tokens(full, turns)

    def _assistant_renders(self, messages: Sequence[Message], full: str) -> list[tuple[str, str]]:
        """For each assistant turn, the render before it (with the generation prompt) and the render
        including it; checked to be prefixes of each other and of ``full``."""
        turns = []
        for j, message in enumerate(messages):
            if message.role != "assistant":
                continue
            if j == 0:
                raise RowError("conversation starts with an assistant turn (nothing prompts it)")
            before = self.render(messages[:j], add_generation_prompt=True)
            after = self.render(messages[: j + 1], add_generation_prompt=False)
            if not after.startswith(before) or not full.startswith(after):
                raise TemplateError(
                    f"chat template is not prefix-stable at message {j}: rendering the conversation "
                    "up to an assistant turn is not a prefix of rendering it whole, so turn "
                    "boundaries cannot be located. Use a template that renders past turns unchanged "
                    "(--chat-template FILE)."
                )
            if len(after) == len(before):
                raise TemplateError(
                    f"chat template renders assistant message {j} as nothing: no assistant tokens "
                    "to supervise. Check the template (--chat-template FILE)."
                )
            turns.append((before, after))
        return turns

    def _mask_by_offsets(self, full: str, spans: list[tuple[int, int]]) -> Tokenized:
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc["input_ids"])
        mask = [0] * len(ids)
        k = 0  # spans and offsets are both ascending: one merge pass
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            while k < len(spans) and spans[k][1] <= start:
                k += 1
            if k < len(spans) and end > spans[k][0] and start < spans[k][1]:
                mask[t] = 1
        self._check_every_turn_masked(mask, len(spans))
        return Tokenized(ids, mask)

    def _mask_by_tokens(self, full: str, turns: list[tuple[str, str]]) -> Tokenized:
        """Slow-tokenizer fallback: compare the token sequences of the renders with the full one.

        The supervised run of a turn starts where the tokens of the prompt render stop agreeing with
        the full conversation (normally at its end; one token earlier when BPE merged across the
        boundary) and ends where the tokens of the render including the turn stop agreeing.
        """
        ids = self._encode(full)
        mask = [0] * len(ids)
        for j, (before, after) in enumerate(turns):
            start = _common_prefix(ids, self._encode(before))
            end = _common_prefix(ids, self._encode(after))
            if end <= start:
                raise TemplateError(f"assistant turn {j} adds no tokens to the conversation")
            mask[start:end] = [1] * (end - start)
        self._check_every_turn_masked(mask, len(turns))
        return Tokenized(ids, mask)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _check_every_turn_masked(mask: list[int], n_turns: int) -> None:
        if n_turns and not any(mask):
            raise TemplateError("the chat template yields no assistant tokens for this conversation")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
