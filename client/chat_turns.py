"""Where a chat template puts a user's turn, read from the template itself: what self-instruct feeds the
verifier (the pre-query text), the token that ends a user turn (the stop token), and a parser for the user
turns of a rendered prompt. Nothing here is written for one template: SmolLM2's and Qwen's ChatML,
DeepSeek-V3's (``<｜User｜>`` ... ``<｜Assistant｜>``), Kimi-K2's and Llama-3's header tokens all come out of
the same three renderings.

    markers = user_turn_markers(tokenizer, "deepseek-v3")
    markers.prefix      # '<｜begin▁of▁sentence｜><｜User｜>': the verifier writes a user turn after it
    markers.end_id      # the id of '<｜Assistant｜>': it ends that turn (the stop token)
    markers.user_turns(tokenizer.decode(prompt_ids))   # ['the first user turn', ...]

How: the template renders placeholder texts (one user turn; then user, assistant, user), and the markers
are the text around them. ``prefix`` is everything before the first user turn's content (the default
system turn included); ``close`` what follows a user turn's content up to the assistant's reply (with the
generation prompt); ``open`` what precedes every user turn's content (the longest text that ends both the
first prefix and the text between an assistant reply and the next user turn). A template that cannot be
read this way (no template, a placeholder lost, a turn that does not end in one special token, a close
that differs between turns) raises ``ChatTemplateError`` naming the model and the reason, before any
request: a wrong marker would give wrong prompts, not an error.

Tested against the real SmolLM2 and DeepSeek-V3 tokenizers and a Llama-3-style template in
``tests/unit/test_chat_turns.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from eagle3.core.errors import Eagle3Error

# placeholder contents: NUL-delimited, so no template's own text contains them and no template strips them
_FIRST, _REPLY, _NEXT = "\x00user-1\x00", "\x00assistant-1\x00", "\x00user-2\x00"


class ChatTemplateError(Eagle3Error, ValueError):
    """The verifier's chat template cannot be read for user-turn markers (``user_turn_markers``)."""


@dataclass(frozen=True)
class UserTurnMarkers:
    prefix: str  # the rendering before the first user message's content: the pre-query text
    open: str  # text before every user message's content
    close: str  # text after a user message's content, up to the assistant's reply (generation prompt on)
    end_token: str  # the first token of ``close``: a verifier ends the user's turn with it
    end_id: int

    def user_turns(self, text: str) -> list[str]:
        """The user turns of a rendered conversation ``text``, in order, stripped."""
        pattern = re.escape(self.open) + "(.*?)" + re.escape(self.close)
        return [turn.strip() for turn in re.findall(pattern, text, re.S)]


def _render(tokenizer: Any, contents: tuple[str, ...]) -> str:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _is_special(tokenizer: Any, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return token_id in added or token_id in (getattr(tokenizer, "all_special_ids", None) or [])


def _from_first_special(tokenizer: Any, text: str) -> str:
    """``text`` from its first special token on (DeepSeek's ``<｜begin▁of▁sentence｜><｜User｜>`` and
    ``<｜end▁of▁sentence｜><｜User｜>`` end alike from ``▁of▁sentence｜>``: the marker is ``<｜User｜>``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {getattr(t, "content", str(t)) for t in added.values()} | set(
        getattr(tokenizer, "all_special_tokens", [])
    )
    starts = [text.find(s) for s in specials if s and s in text]
    return text[min(starts) :] if starts else text


def user_turn_markers(tokenizer: Any, model: str) -> UserTurnMarkers:
    """The markers of ``tokenizer``'s chat template, or ``ChatTemplateError`` naming ``model``."""

    def refuse(reason: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"{model}: self-instruct cannot read where its chat template puts a user turn: {reason}. Write the "
            "prompts another way and give them to `eagle3 prepare`, then `eagle3 distill`"
        )

    try:
        one, three = _render(tokenizer, (_FIRST,)), _render(tokenizer, (_FIRST, _REPLY, _NEXT))
    except Exception as e:
        raise refuse(f"rendering a user turn failed ({type(e).__name__}: {e})") from e
    if one.count(_FIRST) != 1 or any(three.count(m) != 1 for m in (_FIRST, _REPLY, _NEXT)):
        raise refuse("the template drops or repeats a message's content")
    prefix, close = one.split(_FIRST)
    between, last_close = three[three.index(_REPLY) + len(_REPLY) :].split(_NEXT)
    if not close:
        raise refuse("nothing follows a user turn's content, so nothing ends it")
    if last_close != close:
        raise refuse(f"a user turn ends with {close!r} in one conversation and {last_close!r} in another")
    open_ = _from_first_special(tokenizer, os.path.commonprefix([prefix[::-1], between[::-1]])[::-1])
    if not open_:
        raise refuse(f"nothing common precedes the first user turn ({prefix[-40:]!r}) and a later one")
    close_ids = list(tokenizer(close, add_special_tokens=False)["input_ids"])
    end_id = int(close_ids[0]) if close_ids else -1
    end_token = str(tokenizer.decode([end_id])) if close_ids else ""
    if not close_ids or not _is_special(tokenizer, end_id) or not close.startswith(end_token):
        raise refuse(f"a user turn does not end in one special token (it ends with {close[:40]!r})")
    return UserTurnMarkers(prefix=prefix, open=open_, close=close, end_token=end_token, end_id=end_id)
