"""``POST /v1/extract`` request bodies: schema (pydantic, strict ints) then meaning (ids in range,
lengths, unique sample ids, token caps). Every failure is an ``ApiError`` naming the field (``param``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from client.conversations import Message, RowError
from client.masking import ChatTokenizer, TemplateError
from server.errors import ApiError
from server.scheduler import Sample


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr


class SampleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    input_ids: list[StrictInt] | None = None
    loss_mask: list[StrictInt] | None = None
    messages: list[MessageIn] | None = None


class ExtractRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    samples: list[SampleIn] = Field(min_length=1)
    codec: Literal["auto", "zstd+planes", "zstd+shuffle", "zstd", "none"] | None = None
    zstd_level: StrictInt = Field(default=1, ge=1, le=19)


def param_of(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_request(body: bytes) -> ExtractRequest:
    try:
        return ExtractRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = param_of(tuple(first["loc"])) or None
        raise ApiError(400, f"{param or 'body'}: {first['msg']} ({exc.error_count()} error(s))", param=param) from None


def check_samples(
    req: ExtractRequest, *, vocab_size: int, max_model_len: int, max_request_tokens: int, chat: ChatTokenizer | None
) -> list[Sample]:
    """Token ids per sample (messages tokenized with the server's chat template); raises ApiError."""
    out: list[Sample] = []
    seen: set[str] = set()
    total = 0
    for i, s in enumerate(req.samples):
        where = f"samples[{i}]"
        if not s.id:
            raise ApiError(400, f"{where}.id is empty", param=f"{where}.id")
        if s.id in seen:
            raise ApiError(400, f"{where}.id {s.id!r} repeats an earlier sample id", param=f"{where}.id")
        seen.add(s.id)
        ids, mask = _tokens(s, where, chat)
        if not ids:
            raise ApiError(400, f"{where} ({s.id!r}) has no tokens", param=f"{where}.input_ids")
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(
                400,
                f"{where}.input_ids[{bad}] = {ids[bad]} is outside [0, {vocab_size})",
                param=f"{where}.input_ids[{bad}]",
            )
        if len(ids) > max_model_len:
            raise ApiError(
                400,
                f"{where} ({s.id!r}) has {len(ids)} tokens, over max_model_len {max_model_len}",
                param=f"{where}.input_ids",
            )
        if len(mask) != len(ids):
            raise ApiError(
                400, f"{where}.loss_mask has {len(mask)} values for {len(ids)} tokens", param=f"{where}.loss_mask"
            )
        if any(m not in (0, 1) for m in mask):
            raise ApiError(400, f"{where}.loss_mask values must be 0 or 1", param=f"{where}.loss_mask")
        total += len(ids)
        out.append(Sample(i, s.id, ids, mask))
    if total > max_request_tokens:
        raise ApiError(
            400,
            f"request has {total} tokens, over the per-request limit of {max_request_tokens}; "
            "split it into several requests",
            param="samples",
        )
    return out


def _tokens(s: SampleIn, where: str, chat: ChatTokenizer | None) -> tuple[list[int], list[int]]:
    if (s.input_ids is None) == (s.messages is None):
        raise ApiError(400, f"{where} needs exactly one of input_ids or messages", param=where)
    if s.input_ids is not None:
        return s.input_ids, s.loss_mask if s.loss_mask is not None else [0] * len(s.input_ids)
    if s.loss_mask is not None:
        raise ApiError(
            400,
            f"{where}: loss_mask goes with input_ids (messages get theirs from the template)",
            param=f"{where}.loss_mask",
        )
    if chat is None:
        raise ApiError(
            400, "this server's model has no tokenizer with a chat template; send input_ids", param=f"{where}.messages"
        )
    if not s.messages:
        raise ApiError(400, f"{where}.messages is empty", param=f"{where}.messages")
    messages = [Message(m.role, m.content) for m in s.messages]
    try:
        tokenized = chat.tokenize(messages)
    except (RowError, TemplateError) as exc:
        raise ApiError(400, f"{where}: {exc}", param=f"{where}.messages") from None
    return tokenized.input_ids, tokenized.loss_mask
