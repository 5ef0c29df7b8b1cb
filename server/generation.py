"""Generate work: a ``/v1/generate`` request validated into token ids (``check_generate``) and the
scheduler's unit for it (``GenerateUnit``, server/units.py), with the verifier's default stop ids.

A request is one unit: its prompts run together (one left-padded batch on hf, one ``LLM.generate``
on vllm), so a reply depends on its own request only (server/backends/base.py states the invariants).
The unit runs a slice at a time (``Engine.generate_slice_tokens`` new tokens per prompt, where the
backend can stop and resume: hf); between slices it goes back to its request's queue, so other
tenants' work interleaves and a client that leaves (or a drain) stops it after the slice in flight.
It reserves prompt + ``max_new_tokens`` tokens per prompt; each slice is charged the backend time it
took (server/scheduler.py) and counts the tokens it processed (its prompts once, then what it generated).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core

from eagle3.core.conversations import Message, RowError
from eagle3.core.masking import ChatTokenizer, TemplateError
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.generate import GenerateRequest, Sampling
from eagle3.server.backends.base import BackendError, Generation, GenerationRun
from eagle3.server.chat_limits import ChatLimits
from eagle3.server.errors import ApiError
from eagle3.server.units import Engine, Outcome


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
        """Tokens the request processed: prompts plus what was generated."""
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
    """The body as a ``GenerateRequest``, or 400 naming the field. The parser (pydantic's jiter, as
    ``/v1/extract``'s) bounds nesting depth while it reads: a body nested thousands deep is a 400,
    never a ``RecursionError``."""
    try:
        data = pydantic_core.from_json(body)
    except ValueError as exc:
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
    check_sampling: Callable[[Sampling], None] | None = None,
) -> GenerateWork:
    """Token ids per prompt (messages rendered with the generation prompt), each checked against the
    vocabulary and the context (prompt + ``max_new_tokens``), the whole against the request cap; the
    sampling settings against the engine's own validation (``check_sampling``: a ``BackendError``)."""
    sampling = req.sampling
    if check_sampling is not None:
        try:
            check_sampling(sampling)
        except BackendError as exc:
            raise ApiError(400, str(exc), param=getattr(exc.__cause__, "parameter", None)) from None
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


@dataclass(frozen=True)
class GenerateUnit:
    """A generate request as the scheduler's unit (server/units.py): never cached, never batched with
    another, run a slice at a time; ``run`` is the request in progress (None before its first slice)."""

    index: int
    sample_id: str
    work: GenerateWork
    run: GenerationRun | None = field(default=None, compare=False)

    cacheable = False
    sets_rate = False

    @property
    def n_tokens(self) -> int:
        return self.work.n_tokens

    @property
    def input_ids(self) -> list[int]:
        return []  # not cacheable: never looked up

    @property
    def batch_key(self) -> tuple[str, int]:
        return ("generate", id(self))  # alone: its slice is timed and charged by itself

    def run_batch(self, units: Sequence[Any], engine: Engine) -> list[Outcome]:
        return [unit._advance(engine) for unit in units]

    def _advance(self, engine: Engine) -> Outcome:
        first = self.run is None
        run = engine.start_generation(self.work) if self.run is None else self.run
        before = 0 if first else run.generated_tokens
        replies = run.advance(engine.generate_slice_tokens)
        generated = run.generated_tokens - before
        used = (self.work.prompt_tokens if first else 0) + generated
        counters = (("eagle3_tokens_generated_total", generated),)
        if replies is None:
            return Outcome(more=dataclasses.replace(self, run=run), used_tokens=used, counters=counters)
        return Outcome(replies, used_tokens=used, counters=counters)
