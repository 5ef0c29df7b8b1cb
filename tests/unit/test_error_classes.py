"""Every error type of core/protocol/error_types.py, provoked for real against the app in process
(fake backend), with its status, envelope and retry class as the table says; and what must be refused
before the 200 (over-long sample ids) is.

Per class: invalid_request, unauthorized, not_found, method_not_allowed, payload_too_large,
rate_limited, unavailable (loading), backend_error and invalid_sample
(SAMPLE_ERROR frames), internal (ERROR frame). request_timeout and unsupported_media_type:
tests/unit/test_request_limits.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from eagle3.client.errors import InvalidSampleError
from eagle3.client.sdk import to_request_samples
from eagle3.core.protocol.error_types import ERROR_TYPES, default_type, is_retryable
from eagle3.core.protocol.frames import Frame, FrameDecoder, FrameType
from eagle3.core.protocol.limits import MAX_REQUEST_ID_BYTES, MAX_SAMPLE_ID_BYTES
from eagle3.server.app import create_app
from eagle3.server.backends import BackendError
from eagle3.server.config import ServerSettings
from eagle3.server.errors import ApiError
from tests.unit.test_server_app import BlockingBackend, FakeBackend, settings, wait_for

MARK = [990, 991, 992]  # a sample starting with MARK + [kind] makes FaultyBackend fail (warm-up never does)
POISON_TRANSIENT, POISON_INPUT, POISON_GARBAGE = 1, 2, 3


class FaultyBackend(FakeBackend):
    """Fails any batch holding a poison token: a transient engine fault, an input the engine rejects,
    or states that are not a tensor (the stream's encoder then fails)."""

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        kinds = {ids[3] for ids in batch if list(ids[:3]) == MARK and len(ids) == 4}
        if POISON_TRANSIENT in kinds:
            raise RuntimeError("engine worker lost")
        if POISON_INPUT in kinds:
            raise BackendError("the engine rejected the prompt", retryable=False)
        out = super().extract(batch)
        garbage = [*MARK, POISON_GARBAGE]
        return ["not a tensor" if list(ids) == garbage else t for ids, t in zip(batch, out, strict=True)]  # type: ignore[misc]


def frames_of(content: bytes) -> list[Frame]:
    decoder = FrameDecoder()
    frames = decoder.feed(content)
    decoder.close()
    return frames


def assert_envelope(resp: Any, status: int, type_: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_ and error["code"] == status and error["message"], error
    assert resp.headers["x-should-retry"] == ("true" if ERROR_TYPES[type_].retryable else "false")
    return dict(error)


def test_the_table_and_the_envelope_agree() -> None:
    for e in ERROR_TYPES.values():
        assert is_retryable(e.type, e.status) == e.retryable
        if e.status is not None:
            assert default_type(e.status) == e.type
            resp = ApiError(e.status, "x").response()
            assert resp.headers["x-should-retry"] == ("true" if e.retryable else "false")
    assert not is_retryable("invalid_request", 500)  # the type wins over the status
    assert is_retryable("something_new", 502) and not is_retryable("something_new", 400)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    app = create_app(settings(api_keys={"k1": "t1"}), FaultyBackend(tmp_path_factory.mktemp("m")))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.headers["Authorization"] = "Bearer k1"
        wait_for(c, "ready")
        yield c


def test_response_classes(client: TestClient) -> None:
    ok = {"samples": [{"id": "a", "input_ids": [1, 2]}]}
    assert_envelope(client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [5000]}]}), 400,
                    "invalid_request")  # fmt: skip
    assert_envelope(client.post("/v1/extract", json=ok, headers={"Authorization": "Bearer nope"}), 401, "unauthorized")
    assert_envelope(client.get("/v2/nothing"), 404, "not_found")
    assert_envelope(client.get("/v1/extract"), 405, "method_not_allowed")
    assert_envelope(
        client.post("/v1/extract", content=b"x" * (65 << 20), headers={"Content-Type": "application/json"}),
        413,
        "payload_too_large",
    )
    assert client.post("/v1/extract", json=ok).status_code == 200  # and still serving


def test_an_over_long_sample_id_is_a_400_before_the_stream(client: TestClient) -> None:
    """Was a 200 whose stream then failed with a retryable internal error (meta over 1 MiB)."""
    for sample_id in ("x" * (MAX_SAMPLE_ID_BYTES - 1), "\x01" * 200):  # 1025 as JSON; 1202 escaped
        resp = client.post("/v1/extract", json={"samples": [{"id": sample_id, "input_ids": [1]}]})
        error = assert_envelope(resp, 400, "invalid_request")
        assert error["param"] == "samples[0].id" and "1024" in error["message"]
    many = [{"id": f"{i:0>1000}", "input_ids": [1]} for i in range(MAX_REQUEST_ID_BYTES // 1000 + 1)]
    error = assert_envelope(client.post("/v1/extract", json={"samples": many}), 400, "invalid_request")
    assert error["param"] == "samples"
    at_limit = "y" * (MAX_SAMPLE_ID_BYTES - 2)
    frames = frames_of(client.post("/v1/extract", json={"samples": [{"id": at_limit, "input_ids": [1]}]}).content)
    assert [f.type for f in frames] == [FrameType.HEADER, FrameType.DATA, FrameType.END]
    with pytest.raises(InvalidSampleError, match="1024"):  # the SDK refuses it before sending
        to_request_samples([{"id": "x" * 2000, "input_ids": [1]}])


@pytest.mark.parametrize(
    ("poison", "type_", "retryable"),
    [(POISON_TRANSIENT, "backend_error", True), (POISON_INPUT, "invalid_sample", False)],
)
def test_sample_error_classes(client: TestClient, poison: int, type_: str, retryable: bool) -> None:
    body = {"samples": [{"id": "good", "input_ids": [1, 2]}, {"id": "bad", "input_ids": [*MARK, poison]}]}
    frames = frames_of(client.post("/v1/extract", json=body).content)
    by_type = {f.type: f for f in frames}
    assert by_type[FrameType.DATA].meta["sample_id"] == "good"  # the packed batch was split: only one fails
    error = by_type[FrameType.SAMPLE_ERROR].meta["error"]
    assert (error["type"], error["retryable"]) == (type_, retryable), error
    assert by_type[FrameType.END].meta["n_failed"] == 1


def test_stream_internal_error_is_a_retryable_error_frame(client: TestClient) -> None:
    body = {"samples": [{"id": "g", "input_ids": [*MARK, POISON_GARBAGE]}]}
    frames = frames_of(client.post("/v1/extract", json=body).content)
    assert frames[-1].type == FrameType.ERROR
    error = frames[-1].meta["error"]
    assert (error["type"], error["retryable"]) == ("internal", True)


def test_unavailable_while_loading_is_retryable(tmp_path: Path) -> None:
    class SlowLoad(BlockingBackend):
        def load(self, progress: object) -> Any:
            assert self.gate.wait(30)
            return super().load(progress)

    backend = SlowLoad(tmp_path)
    backend.gate.clear()
    with TestClient(create_app(ServerSettings(backend="hf"), backend)) as c:
        resp = c.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]})
        error = assert_envelope(resp, 503, "unavailable")
        assert error["reason"] == "loading" and resp.headers["retry-after"]
        backend.gate.set()


def test_rate_limited_is_retryable(tmp_path: Path) -> None:
    backend = BlockingBackend(tmp_path)
    with TestClient(create_app(settings(max_tenant_inflight_tokens=300), backend)) as c:
        wait_for(c, "ready")
        backend.gate.clear()
        backend.entered.clear()
        body = {"samples": [{"id": "a", "input_ids": [5] * 200}]}
        worker = threading.Thread(target=lambda: c.post("/v1/extract", json=body))
        worker.start()
        assert backend.entered.wait(30)
        resp = c.post("/v1/extract", json={"samples": [{"id": "b", "input_ids": [6] * 200}]})
        assert_envelope(resp, 429, "rate_limited")
        backend.gate.set()
        worker.join(30)


def test_validation_pool_full_is_a_retryable_503(client: TestClient) -> None:
    """Requests validating (or queued for it) are bounded: past TOKENIZE_QUEUE a request gets 503
    ``overloaded`` at once instead of waiting in an unbounded queue."""
    from eagle3.server.runtime import TOKENIZE_QUEUE

    slots = client.app.state.runtime.tokenize_slots  # type: ignore[attr-defined]
    for _ in range(TOKENIZE_QUEUE):
        assert slots.acquire(blocking=False)
    try:
        resp = client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]})
        error = assert_envelope(resp, 503, "unavailable")
        assert error["reason"] == "overloaded" and resp.headers["retry-after"] == "1"
    finally:
        for _ in range(TOKENIZE_QUEUE):
            slots.release()
    assert client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]}).status_code == 200
