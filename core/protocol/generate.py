"""``POST /v1/generate``, typed (stdlib only): the request the SDK sends and the answer it reads back.

A request carries one or more prompts (token ids, or chat messages the server renders with its chat
template and the generation prompt) and one set of sampling settings for all of them. The answer
holds one reply per prompt, in request order: the generated token ids (the stop token included when
one ended the reply) and why it ended.

Validation: ``GenerateRequest.parse`` refuses unknown fields (a misspelt ``max_tokens`` must not be
ignored silently) and ``__post_init__`` checks every value against its range; both raise
``ProtocolError`` with a message that names the field (``GenerateRequest.prompts[2].input_ids``), the
limit and the fix. Limits that depend on the server (vocabulary, context length, token caps) are the
server's to check (server/generate.py). ``GenerateResponse.from_dict`` checks types like every
``WireObject``; unknown keys in an answer are ignored (a newer server may add fields).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from typing import Any

from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.limits import sample_id_problem
from eagle3.core.protocol.wire import WireObject

MAX_NEW_TOKENS_LIMIT = 1 << 20  # a sanity bound; the server's context length is the real one
MAX_SEED = (1 << 63) - 1
FINISH_REASONS = ("stop", "length")  # a stop token ended the reply | max_new_tokens did


@dataclass(frozen=True)
class ChatMessage(WireObject):
    role: str
    content: str


@dataclass(frozen=True)
class GeneratePrompt(WireObject):
    """One prompt: exactly one of ``input_ids`` (used as is: end it with the assistant header) or
    ``messages`` (rendered with the server's chat template and its generation prompt)."""

    id: str
    input_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if (problem := sample_id_problem(self.id)) is not None:
            raise ProtocolError(f"GeneratePrompt.id: {problem}")
        if (self.input_ids is None) == (self.messages is None):
            raise ProtocolError(f"prompt {self.id!r}: send exactly one of input_ids or messages")
        if self.input_ids is not None and not self.input_ids:
            raise ProtocolError(f"prompt {self.id!r}: input_ids is empty")
        if self.messages is not None and not self.messages:
            raise ProtocolError(f"prompt {self.id!r}: messages is empty")


@dataclass(frozen=True)
class Sampling(WireObject):
    """How to continue every prompt of a request. ``temperature == 0`` is greedy (``top_p`` and ``seed``
    are then unused); ``stop_token_ids`` None means the server's end-of-turn ids (``/v1/info``
    ``stop_token_ids``: the tokenizer's eos and the generation config's eos ids)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ProtocolError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ProtocolError(f"temperature must be in [0, 100] (0: greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ProtocolError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ProtocolError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ProtocolError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerateRequest(WireObject):
    """The body of ``POST /v1/generate``: prompts plus the sampling fields of ``Sampling`` at top level."""

    prompts: tuple[GeneratePrompt, ...]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ProtocolError("prompts is empty: send at least one prompt")
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ProtocolError(f"prompt id {dup!r} appears more than once; prompt ids must be unique")
        self.sampling  # noqa: B018 (validates the sampling fields)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.seed, self.stop_token_ids)

    @classmethod
    def parse(cls, data: Any) -> GenerateRequest:
        """``from_dict`` that also refuses unknown fields (here and in every prompt and message)."""
        _no_unknown_keys(cls, data, "")
        if isinstance(data, dict) and isinstance(data.get("prompts"), list):
            for i, prompt in enumerate(data["prompts"]):
                _no_unknown_keys(GeneratePrompt, prompt, f"prompts[{i}].")
                if isinstance(prompt, dict) and isinstance(prompt.get("messages"), list):
                    for j, message in enumerate(prompt["messages"]):
                        _no_unknown_keys(ChatMessage, message, f"prompts[{i}].messages[{j}].")
        return cls.from_dict(data)


def _no_unknown_keys(cls: type[WireObject], data: Any, where: str) -> None:
    if not isinstance(data, dict):
        return
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known fields: {', '.join(known)}"
            raise ProtocolError(f"GenerateRequest.{where}{key}: unknown field{hint}")


@dataclass(frozen=True)
class GeneratedReply(WireObject):
    """One prompt's reply: ``output_ids`` are the generated tokens only (the prompt is not repeated);
    ``finish_reason`` is ``stop`` when the last of them is a stop token, else ``length``; ``text`` is
    ``output_ids`` decoded by the server's tokenizer without special tokens (None from a server
    without a tokenizer, or one older than the field: it is optional both ways)."""

    id: str
    prompt_tokens: int
    output_ids: tuple[int, ...]
    finish_reason: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"GeneratedReply.finish_reason: {self.finish_reason!r} is not one of {FINISH_REASONS}")


@dataclass(frozen=True)
class GenerateResponse(WireObject):
    """The answer of ``POST /v1/generate``: one reply per prompt in request order, the verifier that
    wrote them and the settings used (``stop_token_ids`` resolved)."""

    request_id: str
    model_id: str
    revision: str
    backend: str
    tokenizer_sha256: str
    replies: tuple[GeneratedReply, ...]
    sampling: Sampling
    prompt_tokens: int
    generated_tokens: int
