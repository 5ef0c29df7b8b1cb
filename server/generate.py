"""``POST /v1/generate``: the verifier's continuation of prompts, under the extraction path's rules.

The same gates as ``/v1/extract`` (server/routes.py): the API key (401), readiness (503), a JSON
``Content-Type`` (415), the body size and read timeout (413, 408), the tenant's connection cap (429),
then validation here (400 naming the field and the limit), then admission by the scheduler against the
tenant's and the server's in-flight token budgets (429 / 503 with Retry-After). A request is charged
prompt + ``max_new_tokens`` tokens per prompt while it waits and runs; once it ran, the tenant's
fairness clock keeps only the tokens processed (prompt + generated), see server/scheduler.py.

One request is one unit of work (``GenerateWork``) that the backend runs in one ``generate`` call, so a
reply depends on its own request only (server/backends/base.py states the invariants). The answer is
plain JSON (``GenerateResponse``, core/protocol/generate.py). A client that disconnects while its
request waits is noticed between heartbeats and its work dropped; a drain ends a waiting request with
503 ``draining`` (retryable).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from eagle3.core.conversations import Message, RowError
from eagle3.core.masking import ChatTokenizer, TemplateError
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.generate import GeneratedReply, GenerateRequest, GenerateResponse, Sampling
from eagle3.server.backends.base import Generation
from eagle3.server.chat_limits import ChatLimits
from eagle3.server.errors import ApiError
from eagle3.server.request_limits import ClientGoneError, read_body
from eagle3.server.scheduler import AdmissionError, Result, Sample

if TYPE_CHECKING:
    from eagle3.server.runtime import Runtime

logger = logging.getLogger(__name__)
GENERATE_OPENAPI: dict[str, Any] = {  # the body is read and checked by hand (a byte limit first): say what it is
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "example": {
                    "prompts": [{"id": "q1", "messages": [{"role": "user", "content": "Hi!"}]}],
                    "max_new_tokens": 64,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "seed": None,
                    "stop_token_ids": None,
                }
            }
        },
    },
    "responses": {
        "200": {"description": "GenerateResponse (core/protocol/generate.py; docs/protocol.md, 'Generation')"},
        "400": {
            "description": "a field out of range, prompt + max_new_tokens over max_model_len, over the request cap"
        },
        "401": {"description": "missing or invalid API key"},
        "413": {"description": "body over --max-body-mb"},
        "429": {"description": "the tenant's in-flight quota or open requests are full; Retry-After"},
        "503": {"description": "loading, draining, failed or overloaded; Retry-After"},
    },
}


@dataclass(frozen=True)
class GenerateWork:
    """A validated generate request: token ids per prompt and the sampling settings (stop ids resolved)."""

    prompt_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def n_tokens(self) -> int:
        """The reservation: every prompt plus ``max_new_tokens`` for each."""
        return self.prompt_tokens + len(self.prompts) * self.sampling.max_new_tokens

    def used_tokens(self, result: list[Generation]) -> int:
        """Tokens the request really cost: prompts plus what was generated."""
        return self.prompt_tokens + sum(len(g.output_ids) for g in result)


def default_stop_token_ids(model_dir: str, chat: ChatTokenizer | None) -> tuple[int, ...]:
    """End of turn for this verifier: ``generation_config.json``'s ``eos_token_id`` (an id or a list:
    chat models list their end-of-turn ids there) and the tokenizer's eos id."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        eos = None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(t) for t in eos if isinstance(t, int))
    tokenizer_eos = getattr(chat.tokenizer, "eos_token_id", None) if chat is not None else None
    if isinstance(tokenizer_eos, int):
        ids.add(tokenizer_eos)
    return tuple(sorted(ids))


def parse_generate(body: bytes) -> GenerateRequest:
    """The body as a ``GenerateRequest``, or 400 naming the field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    try:
        return GenerateRequest.parse(data)
    except ProtocolError as exc:
        message = str(exc)
        head = message.split(":", 1)[0]
        param = head.removeprefix("GenerateRequest.") if head.startswith("GenerateRequest.") else None
        raise ApiError(400, message, param=param) from None


def check_generate(
    req: GenerateRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    max_request_tokens: int,
    stop_token_ids: tuple[int, ...],
    chat: ChatTokenizer | None,
    chat_limits: ChatLimits | None,
) -> GenerateWork:
    """Token ids per prompt (messages rendered with the generation prompt), each checked against the
    vocabulary and the context (prompt + ``max_new_tokens``), the whole against the request cap."""
    sampling = req.sampling
    stops = sampling.stop_token_ids if sampling.stop_token_ids is not None else stop_token_ids
    bad_stop = next((t for t in stops if t >= vocab_size), None)
    if bad_stop is not None:
        raise ApiError(400, f"stop_token_ids: {bad_stop} is outside [0, {vocab_size})", param="stop_token_ids")
    new = sampling.max_new_tokens
    prompts: list[tuple[int, ...]] = []
    for i, prompt in enumerate(req.prompts):
        where = f"prompts[{i}]"
        ids = (
            prompt.input_ids
            if prompt.input_ids is not None
            else _render(prompt.messages or (), where, chat, chat_limits)
        )
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"{where}.input_ids[{bad}] = {ids[bad]} is outside [0, {vocab_size})", param=f"{where}.input_ids"
            )
        if len(ids) + new > max_model_len:
            raise ApiError(
                400,
                f"{where} ({prompt.id!r}) has {len(ids)} tokens; with max_new_tokens {new} that is {len(ids) + new}, "
                f"over max_model_len {max_model_len}: lower max_new_tokens or shorten the prompt",
                param=f"{where}",
            )
        prompts.append(tuple(ids))
    work = GenerateWork(
        tuple(p.id for p in req.prompts), tuple(prompts), dataclasses.replace(sampling, stop_token_ids=stops)
    )
    if work.n_tokens > max_request_tokens:
        raise ApiError(
            400,
            f"request needs {work.n_tokens} tokens ({work.prompt_tokens} of prompts + {len(prompts)} x max_new_tokens "
            f"{new}), over the per-request limit of {max_request_tokens}; send fewer prompts per request",
            param="prompts",
        )
    return work


def _render(
    messages: tuple[Any, ...], where: str, chat: ChatTokenizer | None, limits: ChatLimits | None
) -> tuple[int, ...]:
    if chat is None:
        raise ApiError(400, "this server's model has no chat template; send input_ids", param=f"{where}.messages")
    if limits is not None:
        chars = sum(len(m.content) + len(m.role) for m in messages)
        if len(messages) > limits.max_messages or chars > limits.max_chars:
            raise ApiError(
                400,
                f"{where}.messages: {len(messages)} messages / {chars} characters cannot fit the context "
                f"(at most {limits.max_messages} messages, {limits.max_chars} characters): shorten the conversation",
                param=f"{where}.messages",
            )
    try:
        text = chat.render([Message(m.role, m.content) for m in messages], add_generation_prompt=True)
    except (RowError, TemplateError) as exc:
        raise ApiError(400, f"{where}.messages: {exc}", param=f"{where}.messages") from None
    return tuple(chat.tokenizer(text, add_special_tokens=False)["input_ids"])


async def handle_generate(request: Request, tenant: str, rt: Runtime) -> Response:
    """The route's body after auth, readiness, Content-Type and the connection slot (server/routes.py)."""
    info = rt.info
    assert info is not None
    settings = rt.settings
    if not getattr(rt.backend, "can_generate", False):
        raise ApiError(
            400,
            f"the {info.backend} backend cannot generate ({info.model_id}: no model with an lm_head); "
            "serve --backend hf or vllm with a checkpoint",
            param="backend",
        )
    try:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    except ClientGoneError:
        return Response(status_code=400)  # nobody reads it
    parsed = parse_generate(body)
    if not rt.tokenize_slots.acquire(blocking=False):  # bounded: a flood waits in no unbounded queue
        rt.metrics.inc("eagle3_rejections_total", tenant=tenant, reason="overloaded")
        raise ApiError(503, "too many requests being validated; retry shortly", reason="overloaded", retry_after_s=1)
    job = rt.tokenize_pool.submit(
        check_generate,
        parsed,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_tokens=settings.request_token_cap,
        stop_token_ids=rt.stop_token_ids,
        chat=rt.chat,
        chat_limits=rt.chat_limits,
    )
    job.add_done_callback(lambda _: rt.tokenize_slots.release())
    work = await asyncio.wrap_future(job)
    request_id = request.state.request_id
    try:
        req = rt.scheduler.submit(request_id, tenant, [Sample(0, request_id, [], [], generation=work)])
    except AdmissionError as exc:
        raise ApiError(
            exc.status, str(exc), type_=exc.type, reason=exc.reason, retry_after_s=exc.retry_after_s
        ) from None
    started = time.monotonic()
    try:
        results: list[Result] = []
        while not results:
            results = await req.next_results(settings.heartbeat_s)
            if req.abort_error is not None:
                raise ApiError(503, str(req.abort_error["message"]), type_="unavailable", reason="draining",
                               retry_after_s=10)  # fmt: skip
            if not results and await request.is_disconnected():
                logger.info("generate %s: the client left after %.1f s; its work is dropped", request_id,
                            time.monotonic() - started)  # fmt: skip
                return Response(status_code=499)
        rt.scheduler.consumed(req, results[0])
    finally:
        rt.scheduler.close(req)
    result = results[0]
    if result.error is not None:
        retryable = bool(result.error.get("retryable"))
        raise ApiError(500 if retryable else 400, str(result.error["message"]), type_=str(result.error["type"]))
    generations: list[Generation] = result.states
    replies = tuple(
        GeneratedReply(pid, len(ids), tuple(g.output_ids), g.finish_reason)
        for pid, ids, g in zip(work.prompt_ids, work.prompts, generations, strict=True)
    )
    response = GenerateResponse(
        request_id=request_id,
        model_id=info.model_id,
        revision=info.revision,
        backend=info.backend,
        tokenizer_sha256=info.tokenizer_sha256,
        replies=replies,
        sampling=work.sampling,
        prompt_tokens=work.prompt_tokens,
        generated_tokens=sum(len(r.output_ids) for r in replies),
    )
    return JSONResponse(response.to_dict(), headers={"X-Request-Id": request_id, "Cache-Control": "no-store"})
