"""``POST /v1/extract`` request bodies: schema (pydantic, strict ints) then meaning (ids in range,
lengths, unique sample ids, token caps). Every failure is an ``ApiError`` naming the field (``param``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from eagle3.core.conversations import Message, RowError
from eagle3.core.masking import ChatTokenizer, TemplateError
from eagle3.core.protocol.limits import MAX_REQUEST_ID_BYTES, sample_id_bytes, sample_id_problem
from eagle3.core.protocol.wire import REQUEST_CODECS
from eagle3.server.chat_limits import ChatLimits
from eagle3.server.errors import ApiError
from eagle3.server.units import Sample


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
    codec: StrictStr | None = None  # one of eagle3.core.protocol.wire.REQUEST_CODECS (auto: the server picks)
    zstd_level: StrictInt = Field(default=1, ge=1, le=19)
    # "use": served from the feature cache when present (and stored); "bypass": computed, neither read nor
    # stored (eagle3.core.protocol.wire.CACHE_MODES)
    cache: Literal["use", "bypass"] = "use"
    # the states' format on the wire (eagle3.core.protocol.wire.STATE_DTYPES): bf16 as computed, or FP8
    # (e4m3fn codes + a float32 scale per token and layer, quantized from those bf16 states: core/fp8.py)
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str | None) -> str | None:
        if value is not None and value not in REQUEST_CODECS:
            raise ValueError(f"unknown codec {value!r}; choose one of {', '.join(REQUEST_CODECS)}")
        return value


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
    req: ExtractRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    max_request_tokens: int,
    chat: ChatTokenizer | None,
    chat_limits: ChatLimits | None = None,
) -> list[Sample]:
    """Token ids per sample (messages tokenized with the server's chat template); raises ApiError.
    ``chat_limits`` bound the chat input before any of it is rendered (server/chat_limits.py)."""
    if chat_limits is not None:
        check_chat_size(req, chat_limits, max_request_tokens)
    out: list[Sample] = []
    seen: set[str] = set()
    total = id_bytes = 0
    for i, s in enumerate(req.samples):
        where = f"samples[{i}]"
        if (problem := sample_id_problem(s.id)) is not None:
            raise ApiError(400, f"{where}.id: {problem}", param=f"{where}.id")
        id_bytes += sample_id_bytes(s.id)
        if id_bytes > MAX_REQUEST_ID_BYTES:
            raise ApiError(
                400,
                f"the sample ids of this request total over {MAX_REQUEST_ID_BYTES} bytes as JSON; "
                "send fewer samples per request or shorter ids",
                param="samples",
            )
        if s.id in seen:
            raise ApiError(400, f"{where}.id {s.id!r} repeats an earlier sample id", param=f"{where}.id")
        seen.add(s.id)
        ids, mask = _tokens(s, where, chat, max_model_len if chat_limits is not None else None)
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
        if len(req.samples) == 1:  # one sample cannot be split across requests: say what can be done instead
            raise ApiError(
                400,
                f"sample {req.samples[0].id!r} has {total} tokens, over the per-request limit of "
                f"{max_request_tokens} (max_request_tokens on /v1/info); a sample is never split across "
                f"requests: truncate it to at most {max_request_tokens} tokens, or run the server with a larger "
                "--max-request-tokens (and in-flight quotas)",
                param="samples[0].input_ids",
            )
        raise ApiError(
            400,
            f"request has {total} tokens, over the per-request limit of {max_request_tokens}; "
            "split it into several requests",
            param="samples",
        )
    return out


def check_chat_size(req: ExtractRequest, limits: ChatLimits, max_request_tokens: int) -> None:
    """400 for chat input that cannot fit the token caps, in O(messages), before any rendering."""
    total = 0
    for i, s in enumerate(req.samples):
        if not s.messages:
            continue
        where = f"samples[{i}].messages"
        if len(s.messages) > limits.max_messages:
            raise ApiError(
                400,
                f"{where} has {len(s.messages)} messages; at most {limits.max_messages} fit max_model_len "
                f"{limits.max_chars // limits.longest_token_chars} with this chat template: split the conversation",
                param=where,
            )
        chars = sum(len(m.content) + len(m.role) for m in s.messages)
        if chars > limits.max_chars:
            raise ApiError(
                400,
                f"{where} has {chars} characters; more than {limits.max_chars} cannot fit max_model_len "
                "tokens: shorten the conversation",
                param=where,
            )
        total += chars
    if total > limits.request_chars(max_request_tokens):
        one = len(req.samples) == 1  # one conversation cannot be split across requests
        raise ApiError(
            400,
            f"the request's messages have {total} characters, more than its {max_request_tokens}-token cap "
            "can hold; "
            + (
                "a sample is never split across requests: shorten the conversation, or run the server with a "
                "larger --max-request-tokens"
                if one
                else "split it into several requests"
            ),
            param="samples",
        )


def _tokens(
    s: SampleIn, where: str, chat: ChatTokenizer | None, max_model_len: int | None = None
) -> tuple[list[int], list[int]]:
    """The sample's ids and mask. For ``messages`` with ``max_model_len``: the whole conversation is
    rendered and counted once (O(length)) before the per-turn renders of the mask (O(turns x length)),
    so a conversation over the limit never pays for those."""
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
        if max_model_len is not None:
            text = chat.render(messages, add_generation_prompt=False)
            n_tokens = len(chat.tokenizer(text, add_special_tokens=False)["input_ids"])
            if n_tokens > max_model_len:
                raise ApiError(
                    400,
                    f"{where} ({s.id!r}) has {n_tokens} tokens, over max_model_len {max_model_len}",
                    param=f"{where}.messages",
                )
        tokenized = chat.tokenize(messages)
    except (RowError, TemplateError) as exc:
        raise ApiError(400, f"{where}: {exc}", param=f"{where}.messages") from None
    return tokenized.input_ids, tokenized.loss_mask
