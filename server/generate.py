"""``POST /v1/generate``: the verifier's continuation of prompts, under the extraction path's rules.

The same gates as ``/v1/extract`` (server/routes.py): the API key (401), readiness (503), a JSON
``Content-Type`` (415), the body size and read timeout (413, 408), the tenant's connection cap (429),
then validation here (400 naming the field and the limit), then admission by the scheduler against the
tenant's and the server's in-flight token budgets (429 / 503 with Retry-After). A request is charged
prompt + ``max_new_tokens`` tokens per prompt while it waits and runs; each slice is charged to the
tenant's fairness clock by the backend time it took, see server/scheduler.py.

One request is one unit of work (``GenerateUnit``, server/generation.py) that the backend runs a slice
at a time, so a reply depends on its own request only (server/backends/base.py states the invariants).
The answer is plain JSON (``GenerateResponse``, core/protocol/generate.py). A client that disconnects
is noticed between heartbeats and its work dropped (a generate between slices stops there); a drain
ends a waiting request with 503 ``draining`` (retryable). The reading, checking and admission are the
extraction route's own (server/admission.py).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from eagle3.core.protocol.generate import GeneratedReply, GenerateRequest, GenerateResponse
from eagle3.server.admission import admit
from eagle3.server.backends.base import Generation
from eagle3.server.errors import ApiError
from eagle3.server.generation import GenerateUnit, GenerateWork, check_generate, parse_generate
from eagle3.server.request_state import Request as SchedulerRequest
from eagle3.server.request_state import Result

if TYPE_CHECKING:
    from eagle3.server.runtime import Runtime

__all__ = ["GENERATE_OPENAPI", "GenerateWork", "handle_generate"]
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


async def handle_generate(request: Request, tenant: str, rt: Runtime) -> Response:
    """The route's body after auth, readiness, Content-Type and the connection slot (server/routes.py)."""
    info = rt.info
    assert info is not None
    if not rt.can_generate:
        raise ApiError(
            400,
            f"the {info.backend} backend cannot generate ({info.model_id}: no model with an lm_head); "
            "serve --backend hf or vllm with a checkpoint",
            param="backend",
        )
    check = functools.partial(
        check_generate,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_request_tokens=rt.settings.request_token_cap,
        stop_token_ids=rt.stop_token_ids,
        chat=rt.chat,
        chat_limits=rt.chat_limits,
        check_sampling=rt.check_sampling,
    )
    request_id = request.state.request_id

    def submit(_: GenerateRequest, work: GenerateWork) -> tuple[GenerateWork, SchedulerRequest]:
        return work, rt.scheduler.submit(request_id, tenant, [GenerateUnit(0, request_id, work)])

    admitted = await admit(request, tenant, rt, parse_generate, check, submit)
    if admitted is None:
        return Response(status_code=400)  # the client left during the upload: nobody reads it
    work, req = admitted
    result = await _wait(request, rt, req)
    if result is None:
        return Response(status_code=499)
    if result.error is not None:
        retryable = bool(result.error.get("retryable"))
        raise ApiError(500 if retryable else 400, str(result.error["message"]), type_=str(result.error["type"]))
    generations: list[Generation] = result.states
    tokenizer = rt.chat.tokenizer if rt.chat is not None else None
    replies = tuple(
        GeneratedReply(
            pid,
            len(ids),
            tuple(g.output_ids),
            g.finish_reason,
            tokenizer.decode(g.output_ids, skip_special_tokens=True) if tokenizer is not None else None,
        )
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


async def _wait(request: Request, rt: Runtime, req: SchedulerRequest) -> Result | None:
    """The unit's result; None when the client left first (its work is dropped: a generate between
    slices is not run again). A drain's abort is a 503 ``draining``."""
    started = time.monotonic()
    try:
        results: list[Result] = []
        while not results:
            results = await req.next_results(rt.settings.heartbeat_s)
            if req.abort_error is not None:
                raise ApiError(
                    503, str(req.abort_error["message"]), type_="unavailable", reason="draining", retry_after_s=10
                )
            if not results and await request.is_disconnected():
                logger.info(
                    "generate %s: the client left after %.1f s; its work is dropped",
                    req.request_id,
                    time.monotonic() - started,
                )
                return None
        rt.scheduler.consumed(req, results[0])
    finally:
        rt.scheduler.close(req)
    return results[0]
