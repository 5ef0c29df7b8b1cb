"""``/v1/generate``'s bad input is a 400, never a retryable 500 (issue 31 R4, R5): a body nested 10^5 deep
is refused by the parser's depth bound (it was a ``RecursionError``, a 500 with two tracebacks), and
sampling settings the engine refuses (vLLM's temperature in [0, 2], the wire's [0, 100]) are refused
before admission by the engine's own validation, naming its limit."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

from eagle3.core.protocol.generate import GenerateRequest, Sampling
from eagle3.server.backends.base import BackendConfig, BackendError
from eagle3.server.errors import ApiError
from eagle3.server.generation import check_generate, parse_generate


def test_a_deeply_nested_body_is_a_400() -> None:
    depth = 100_000
    body = b'{"prompts": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(ApiError) as exc:
        parse_generate(body)
    assert exc.value.status == 400 and "recursion limit" in str(exc.value)
    ok = parse_generate(b'{"prompts": [{"id": "a", "input_ids": [1, 2]}], "max_new_tokens": 3}')
    assert ok.prompts[0].input_ids == (1, 2) and ok.max_new_tokens == 3


def checked(temperature: float, check: Callable[[Sampling], None]) -> object:
    req = GenerateRequest.parse({"prompts": [{"id": "a", "input_ids": [1, 2]}], "temperature": temperature})
    return check_generate(
        req,
        vocab_size=10,
        max_model_len=100,
        max_request_tokens=1000,
        stop_token_ids=(2,),
        chat=None,
        chat_limits=None,
        check_sampling=check,
    )


def test_the_engines_refusal_is_a_400_naming_its_limit() -> None:
    def engine_check(sampling: Sampling) -> None:
        if sampling.temperature > 2:
            raise BackendError(f"temperature must be in [0, 2], got {sampling.temperature}", retryable=False)

    assert checked(1.5, engine_check) is not None
    with pytest.raises(ApiError) as exc:
        checked(3.0, engine_check)
    assert exc.value.status == 400 and "[0, 2]" in str(exc.value)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_sampling_limits_are_vllms_own() -> None:
    """vLLM's ``SamplingParams`` validation, without an engine: its refusal is non-retryable."""
    from eagle3.server.backends.vllm import VllmBackend

    backend = VllmBackend(BackendConfig(model="unused"))
    backend.check_sampling(Sampling(max_new_tokens=4, temperature=2.0, stop_token_ids=(2,)))
    with pytest.raises(BackendError) as exc:
        backend.check_sampling(Sampling(max_new_tokens=4, temperature=3.0, stop_token_ids=(2,)))
    assert exc.value.retryable is False and "temperature" in str(exc.value)
    with pytest.raises(ApiError) as api:
        checked(50.0, backend.check_sampling)
    assert api.value.status == 400 and "temperature" in str(api.value)
