"""``generate``: the verifier's replies through ``POST /v1/generate`` (core/protocol/generate.py).

    with ExtractionClient("http://gpu-node:8000") as c:
        out = c.generate([[{"role": "user", "content": "Hi!"}]], max_new_tokens=32)
        out.replies[0].output_ids      # the generated ids, the stop token last when one ended it
        out.replies[0].text            # the same, decoded by the server's tokenizer (no special tokens)

One call is one request, and the server runs a request as one unit: a reply depends only on the
prompts and settings of its own call (greedy is the backend's own greedy decoding; a seeded sampled
call returns the same tokens every time on the same server). The request is validated here before it
is sent (``InvalidSampleError`` naming the prompt and field); a failed call raises the SDK's error tree
(client/errors.py) and is retried like every SDK request (client/retry.py: connection errors, 429,
5xx; never 400, 401, 413). A generate request returns nothing until all its replies are done, so its
read timeout is ``timeout_s`` (default: the client's; raise it for long replies on a slow server).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from eagle3.client.errors import APIError, InvalidSampleError
from eagle3.core.protocol.frames import ProtocolError
from eagle3.core.protocol.generate import GenerateRequest, GenerateResponse
from eagle3.core.protocol.prepared import PreparedSample

if TYPE_CHECKING:
    from eagle3.client.async_sdk import AsyncExtractionClient
    from eagle3.client.sdk import ExtractionClient

Prompt = Any  # list[int] | list[message] | {"id"?, "input_ids"} | {"id"?, "messages"}


def generate_request(
    prompts: Iterable[Prompt],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
) -> GenerateRequest:
    """The typed request for ``prompts`` (ids default to positions); ``InvalidSampleError`` when malformed."""
    body: dict[str, Any] = {
        "prompts": [_prompt(p, i) for i, p in enumerate(prompts)],
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop_token_ids": None if stop_token_ids is None else list(stop_token_ids),
    }
    try:
        return GenerateRequest.parse(body)
    except ProtocolError as exc:
        raise InvalidSampleError(f"generate request: {exc}") from None


def _prompt(prompt: Prompt, index: int) -> dict[str, Any]:
    if isinstance(prompt, PreparedSample):
        raise InvalidSampleError(
            f"prompt {index}: a PreparedSample holds a whole conversation; pass its prompt ids "
            "(the tokens before its first supervised one)"
        )
    if hasattr(prompt, "tolist"):  # numpy array of token ids
        prompt = prompt.tolist()
    if isinstance(prompt, Mapping):
        out = dict(prompt)
        if hasattr(out.get("input_ids"), "tolist"):
            out["input_ids"] = out["input_ids"].tolist()
        out.setdefault("id", str(index))
        return out
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return {"id": str(index), "messages": [dict(m) for m in prompt]}
    if isinstance(prompt, (list, tuple)):
        return {"id": str(index), "input_ids": list(prompt)}
    raise InvalidSampleError(
        f"prompt {index}: expected token ids, chat messages or a dict, got {type(prompt).__name__}"
    )


def generate(
    client: ExtractionClient,
    prompts: Iterable[Prompt],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    timeout_s: float | None = None,
) -> GenerateResponse:
    """One ``POST /v1/generate``: a reply per prompt, in order (see the module docstring)."""
    request = generate_request(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
    )
    body = request.to_dict()

    def call(url: str) -> GenerateResponse:
        request_id = uuid.uuid4().hex
        answer = client._call_json("POST", url, "/v1/generate", request_id, body, timeout_s, parse=False)
        return generate_answer(answer, url, request_id, request)

    result: GenerateResponse = client._with_retries(call)
    return result


async def agenerate(
    client: AsyncExtractionClient,
    prompts: Iterable[Prompt],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    timeout_s: float | None = None,
) -> GenerateResponse:
    """``generate`` of the async client: the same request, checks and retries."""
    request = generate_request(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
    )
    body = request.to_dict()

    async def call(url: str) -> GenerateResponse:
        request_id = uuid.uuid4().hex
        answer = await client._call_json("POST", url, "/v1/generate", request_id, body, timeout_s, parse=False)
        return generate_answer(answer, url, request_id, request)

    result: GenerateResponse = await client._with_retries(call)
    return result


def generate_answer(answer: Any, url: str, request_id: str, request: GenerateRequest) -> GenerateResponse:
    """A 200 answer (``httpx.Response``) to ``request`` as the typed response: one reply per prompt, in order."""
    try:
        out = GenerateResponse.from_dict(answer.json())
    except (ProtocolError, ValueError) as exc:
        raise APIError(f"{url}/v1/generate: unexpected answer ({exc})", url=url, request_id=request_id) from None
    got = [r.id for r in out.replies]
    want = [p.id for p in request.prompts]
    if got != want:
        raise APIError(f"{url}/v1/generate: replies for {got[:5]}, asked for {want[:5]}", url=url)
    return out
