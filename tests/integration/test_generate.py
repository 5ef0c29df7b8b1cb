"""``POST /v1/generate`` on the hf backend with the embedded SmolLM2 (fp32), through the SDK.

* Greedy replies equal transformers' ``model.generate(do_sample=False)`` token for token: one prompt
  per request against transformers on that prompt alone, and a several-prompt request against
  transformers' batched generate on the same left-padded batch (a request is one unit of work).
* Chat messages are rendered with the template's generation prompt; replies end at the end-of-turn id.
* Seeded sampling repeats; fairness and budgets apply: the tenant's reservation, the 400s naming the
  limit, 401 without the key, 413 over the body limit, and the generated-token counter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from eagle3.client.errors import AuthenticationError, BadRequestError, InvalidSampleError, PayloadTooLargeError
from eagle3.client.sdk import ExtractionClient
from eagle3.server.app import create_app
from eagle3.server.config import ServerSettings

pytestmark = pytest.mark.integration
KEY = "k-generate"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Tell me a joke about computers."}],
    [{"role": "user", "content": "hi"}],
]


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[TestClient]:
    settings = ServerSettings(
        model=str(smollm2_dir),
        backend="hf",
        dtype="float32",
        max_batch_tokens=2048,
        max_request_tokens=4096,
        max_body_bytes=64 << 10,
        api_keys={KEY: "tenant-a"},
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 300
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.5)
        yield client


@pytest.fixture(scope="module")
def sdk(server: TestClient) -> Iterator[ExtractionClient]:
    with ExtractionClient(str(server.base_url), api_key=KEY, http_client=server, max_retries=0) as client:  # type: ignore[arg-type]
        yield client


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def prompt_ids(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_greedy_equals_transformers_generate(sdk: ExtractionClient, reference: Any, smollm2_tokenizer: Any) -> None:
    info = sdk.info()
    assert info.can_generate and info.stop_token_ids == (2,)  # SmolLM2: <|im_end|> is eos
    n_new = 24
    prompts = [prompt_ids(smollm2_tokenizer, chat) for chat in CHATS]
    finish = set()
    for ids in prompts:  # one prompt per request: transformers on that prompt alone
        got = sdk.generate([ids], max_new_tokens=n_new).replies[0]
        with torch.inference_mode():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)[0, len(ids) :]
        assert list(got.output_ids) == want.tolist(), smollm2_tokenizer.decode(want)
        assert got.text == smollm2_tokenizer.decode(want, skip_special_tokens=True) and got.text
        assert got.prompt_tokens == len(ids)
        finish.add(got.finish_reason)
        assert got.finish_reason == ("stop" if got.output_ids[-1] == 2 else "length")
    assert "stop" in finish, "no reply ended at the end of turn within 24 tokens"
    # several prompts in one request: transformers' batched generate on the same left-padded batch
    batch = sdk.generate(prompts, max_new_tokens=n_new)
    width = max(len(p) for p in prompts)
    padded = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        rows = reference.generate(input_ids=padded, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                                  pad_token_id=2)[:, width:].tolist()  # fmt: skip
    for reply, row in zip(batch.replies, rows, strict=True):
        want = row[: row.index(2) + 1] if 2 in row else row
        assert list(reply.output_ids) == want
    # messages are rendered with the generation prompt: the same reply as their ids
    by_chat = sdk.generate([{"id": "c", "messages": CHATS[0]}], max_new_tokens=n_new).replies[0]
    alone = sdk.generate([prompts[0]], max_new_tokens=n_new).replies[0]
    assert by_chat.output_ids == alone.output_ids and by_chat.prompt_tokens == len(prompts[0])


def test_sampling_is_seeded_and_stops_where_asked(sdk: ExtractionClient, smollm2_tokenizer: Any) -> None:
    ids = prompt_ids(smollm2_tokenizer, CHATS[1])
    first = sdk.generate([ids], max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7).replies[0]
    again = sdk.generate([ids], max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7).replies[0]
    assert first.output_ids == again.output_ids
    others = {sdk.generate([ids], max_new_tokens=24, temperature=1.0, seed=s).replies[0].output_ids for s in range(4)}
    assert len(others) > 1, "four seeds gave the same sample"
    greedy = sdk.generate([ids], max_new_tokens=24).replies[0].output_ids
    stop_at = greedy[3]  # a token the greedy reply emits: asking to stop there cuts the reply after it
    cut = sdk.generate([ids], max_new_tokens=24, stop_token_ids=[stop_at]).replies[0]
    assert cut.finish_reason == "stop" and cut.output_ids == greedy[: greedy.index(stop_at) + 1]
    none = sdk.generate([ids], max_new_tokens=5, stop_token_ids=[]).replies[0]
    assert none.finish_reason == "length" and len(none.output_ids) == 5


def test_limits_and_auth(server: TestClient, sdk: ExtractionClient) -> None:
    url = str(server.base_url)
    body = {"prompts": [{"id": "a", "input_ids": [1, 2, 3]}], "max_new_tokens": 4}
    anonymous = server.post("/v1/generate", json=body)
    assert anonymous.status_code == 401 and "API key" in anonymous.json()["error"]["message"]
    with (
        ExtractionClient(url, api_key="wrong", http_client=server, max_retries=0) as bad,  # type: ignore[arg-type]
        pytest.raises(AuthenticationError),
    ):
        bad.generate([[1, 2, 3]], max_new_tokens=4)
    max_len = sdk.info().max_model_len
    with pytest.raises(BadRequestError, match=f"over max_model_len {max_len}: lower max_new_tokens") as exc:
        sdk.generate([[1, 2, 3]], max_new_tokens=max_len)
    assert exc.value.param == "prompts[0]"
    with pytest.raises(BadRequestError, match="over the per-request limit of 4096"):
        sdk.generate([[1] * 10] * 40, max_new_tokens=100)
    with pytest.raises(BadRequestError, match=r"input_ids\[1\] = 999999 is outside \[0, 49152\)"):
        sdk.generate([[1, 999999]], max_new_tokens=4)
    with pytest.raises(PayloadTooLargeError, match="max-body-mb"):
        sdk.generate([[12345] * 20000], max_new_tokens=1)
    headers = {"Authorization": f"Bearer {KEY}"}
    typo = server.post("/v1/generate", json={**body, "max_tokens": 4}, headers=headers)
    assert typo.status_code == 400 and "did you mean 'max_new_tokens'" in typo.json()["error"]["message"]
    wrong = server.post("/v1/generate", json={**body, "temperature": -1}, headers=headers)
    assert wrong.status_code == 400 and "temperature must be in [0, 100]" in wrong.json()["error"]["message"]
    text = server.post("/v1/generate", content=b"{}", headers={**headers, "Content-Type": "text/plain"})
    assert text.status_code == 415
    with pytest.raises(InvalidSampleError, match="unique"):
        sdk.generate([{"id": "x", "input_ids": [1]}, {"id": "x", "input_ids": [2]}])


def test_budgets_and_fairness_count_generated_tokens(server: TestClient, sdk: ExtractionClient) -> None:
    rt = server.app.state.runtime  # type: ignore[attr-defined]
    served_before = rt.scheduler.fair.served.get("tenant-a", 0)
    generated_before = rt.metrics.get("eagle3_tokens_generated_total", tenant="tenant-a")
    out = sdk.generate([[1, 9690, 198], [1, 4093, 198, 19556]], max_new_tokens=6, stop_token_ids=[])
    assert out.generated_tokens == 12 and out.prompt_tokens == 7
    assert rt.metrics.get("eagle3_tokens_generated_total", tenant="tenant-a") - generated_before == 12
    # the fairness clock keeps what was processed: prompts + generated, not the reservation
    assert rt.scheduler.fair.served["tenant-a"] - served_before == 7 + 12
    assert rt.scheduler.tenant_inflight.get("tenant-a", 0) == 0 and rt.scheduler.inflight_tokens == 0
    # over the tenant's in-flight quota: 429 before any work
    rt.scheduler.max_tenant_inflight_tokens = 50
    try:
        resp = server.post("/v1/generate", json={"prompts": [{"id": "a", "input_ids": [1] * 10}], "max_new_tokens": 60},
                           headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    finally:
        rt.scheduler.max_tenant_inflight_tokens = rt.settings.max_tenant_inflight_tokens
    assert resp.status_code == 429 and resp.json()["error"]["reason"] == "tenant_quota"
    assert "Retry-After" in resp.headers


def test_synthetic_backend_says_it_cannot_generate(smollm2_dir: Path) -> None:
    settings = ServerSettings(model=str(smollm2_dir), backend="synthetic", max_batch_tokens=256)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert client.get("/v1/info").json()["can_generate"] is False
        resp = client.post("/v1/generate", json={"prompts": [{"id": "a", "input_ids": [1, 2]}]})
        assert resp.status_code == 400 and "synthetic backend cannot generate" in resp.json()["error"]["message"]


def test_a_generate_runs_in_slices_that_other_work_and_a_leaving_client_interrupt(server: TestClient) -> None:
    """Issue 31 R3 on the real hf backend: a 400-token generate runs 16 new tokens per slice; another
    tenant's 4-token extract is served after the slice in flight, and once the generate's client has
    gone (``close``) at most the slice in flight still runs."""
    import asyncio

    from eagle3.core.protocol.generate import Sampling
    from eagle3.server.generation import GenerateUnit, GenerateWork
    from eagle3.server.request_state import GENERATE_SLICE_TOKENS
    from eagle3.server.units import Sample

    rt = server.app.state.runtime  # type: ignore[attr-defined]
    sched = rt.scheduler

    def generated() -> float:
        return float(rt.metrics.get("eagle3_tokens_generated_total", tenant="tenant-long"))

    async def main() -> None:
        work = GenerateWork(("p",), ((1, 9690, 198),), Sampling(max_new_tokens=400, stop_token_ids=()))
        gen = sched.submit("long", "tenant-long", [GenerateUnit(0, "long", work)])
        try:
            while generated() < GENERATE_SLICE_TOKENS:  # its first slice is done
                await asyncio.sleep(0.01)
            before = generated()
            small = sched.submit("small", "tenant-small", [Sample(0, "x", [1, 2, 3, 4], [1] * 4)])
            results: list[Any] = []
            while not results:
                results = await small.next_results(5.0)
            sched.consumed(small, results[0])
            sched.close(small)
            assert results[0].error is None and results[0].states.shape[0] == 4
            assert generated() - before <= GENERATE_SLICE_TOKENS, "the extract waited for more than the slice in flight"
        finally:
            sched.close(gen)  # the client left
        at_close = generated()
        await asyncio.sleep(3.0)
        assert generated() - at_close <= GENERATE_SLICE_TOKENS, "the generate went on after its client left"
        assert generated() < 200, "it ran (nearly) to its 400 tokens"

    asyncio.run(main())
    assert sched.tenant_inflight.get("tenant-long", 0) == 0
