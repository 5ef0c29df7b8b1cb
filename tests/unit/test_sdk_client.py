"""ExtractionClient against real frame streams served through httpx.MockTransport."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest

from eagle3.client.errors import (
    APIConnectionError,
    AuthenticationError,
    BadRequestError,
    InvalidSampleError,
    RateLimitError,
    SampleFailedError,
    ServiceUnavailableError,
    StreamError,
)
from eagle3.client.sdk import ExtractionClient
from eagle3.core.codec import bf16_to_float32
from eagle3.core.protocol import PreparedSample
from tests.unit.sdk_fake import AUX, FINAL, HIDDEN, Call, FakeServer, expected_hidden, tokenize_messages


def make_client(server: FakeServer, sleeps: list[float] | None = None, **kwargs: Any) -> ExtractionClient:
    record = sleeps if sleeps is not None else []
    return ExtractionClient("http://fake:8000", transport=server.transport(), sleep=record.append, **kwargs)


def test_round_trip_token_ids_messages_and_a_chunked_sample():
    server = FakeServer(max_payload_bytes=10 * (len(AUX) + 1) * HIDDEN * 2)  # 10 rows per DATA frame
    long_ids = [(7 * i) % 250 + 1 for i in range(37)]  # 4 chunks
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]
    samples = [[5, 6, 7], {"id": "long", "input_ids": long_ids, "loss_mask": [1] * 37}, messages]
    with make_client(server) as client:
        out = list(client.extract(samples))
    assert [s.sample_id for s in out] == ["0", "long", "2"]
    assert out[0].input_ids.tolist() == [5, 6, 7] and out[0].loss_mask.tolist() == [0, 0, 0]
    long = out[1]
    assert long.n_tokens == 37 and long.loss_mask.tolist() == [1] * 37
    np.testing.assert_array_equal(long.hidden_states_bf16, expected_hidden(long_ids))
    assert long.hidden_states.dtype == np.float32 and long.hidden_states.shape == (37, len(AUX) + 1, HIDDEN)
    np.testing.assert_array_equal(long.hidden_states, bf16_to_float32(expected_hidden(long_ids)))
    np.testing.assert_array_equal(long.aux_hidden_states, long.hidden_states[:, :-1])
    np.testing.assert_array_equal(long.final_hidden_state, long.hidden_states[:, -1])
    np.testing.assert_array_equal(long.layer(AUX[1]), long.hidden_states[:, 1])
    assert long.layer_ids == (*AUX, FINAL)
    ids, mask = tokenize_messages(messages)
    assert out[2].input_ids.tolist() == ids and out[2].loss_mask.tolist() == mask
    assert server.requests[0]["samples"][2] == {"id": "2", "messages": messages}
    assert client.wire_bytes > 0


def test_numpy_ids_and_prepared_samples_are_accepted():
    server = FakeServer()
    prepared = PreparedSample("p1", [3, 4], [0, 1])
    with make_client(server) as client:
        out = list(client.extract([np.array([1, 2, 3]), prepared]))
    assert [s.sample_id for s in out] == ["0", "p1"]
    assert server.requests[0]["samples"][1] == {"id": "p1", "input_ids": [3, 4], "loss_mask": [0, 1]}


@pytest.mark.parametrize(
    ("samples", "message"),
    [([[]], "non-empty"), ([[1, "a"]], "integers"), ([{"foo": 1}], "input_ids"), ([{"id": "a", "input_ids": [1]},
     {"id": "a", "input_ids": [2]}], "duplicate"), ([3], "expected token ids")],
)  # fmt: skip
def test_malformed_samples_fail_before_sending(samples, message):
    server = FakeServer()
    with make_client(server) as client, pytest.raises(InvalidSampleError, match=message):
        client.extract(samples)
    assert server.requests == []


def test_checksum_failure_is_a_stream_error_not_retried():
    server = FakeServer(script=[Call(corrupt_frame=1)])
    with make_client(server) as client, pytest.raises(StreamError, match="checksum"):
        list(client.extract([[1, 2], [3, 4], [5, 6]]))
    assert len(server.requests) == 1


def test_truncated_stream_retries_only_the_missing_samples():
    server = FakeServer(script=[Call(truncate_after_samples=2)])
    sleeps: list[float] = []
    samples = [{"id": f"s{i}", "input_ids": [i + 1, i + 2]} for i in range(5)]
    with make_client(server, sleeps) as client:
        out = list(client.extract(samples))
    assert [s.sample_id for s in out] == [f"s{i}" for i in range(5)]
    assert [r["id"] for r in server.requests[1]["samples"]] == ["s2", "s3", "s4"]
    assert len(sleeps) == 1 and 0 < sleeps[0] <= 0.5


def test_stream_broken_by_a_read_error_midway_resumes():
    server = FakeServer()
    calls = {"n": 0}
    inner = server.handle

    def handle(request: httpx.Request) -> httpx.Response:
        resp = inner(request)
        if request.url.path == "/v1/extract" and calls["n"] == 0:
            calls["n"] += 1
            data = resp.read()

            def broken():
                yield data[: len(data) // 2]
                raise httpx.ReadError("connection reset", request=request)

            return httpx.Response(200, content=broken(), headers=resp.headers)
        return resp

    samples = [{"id": f"s{i}", "input_ids": list(range(1, 20))} for i in range(6)]
    client = ExtractionClient("http://fake", transport=httpx.MockTransport(handle), sleep=lambda s: None)
    out = list(client.extract(samples))
    assert sorted(s.sample_id for s in out) == [f"s{i}" for i in range(6)]
    assert 0 < len(server.requests[1]["samples"]) < 6


@pytest.mark.parametrize(("status", "error"), [(429, RateLimitError), (503, ServiceUnavailableError)])
def test_retry_after_is_honoured(status, error):
    server = FakeServer(script=[Call(status=status, headers={"Retry-After": "7"}), Call()])
    sleeps: list[float] = []
    with make_client(server, sleeps) as client:
        assert [s.sample_id for s in client.extract([[1, 2]])] == ["0"]
    assert sleeps == [7.0]
    # out of retries: the typed error with the server's envelope
    server = FakeServer(script=[Call(status=status, headers={"Retry-After": "999"})] * 3)
    sleeps = []
    with make_client(server, sleeps, max_retries=2) as client, pytest.raises(error) as info:
        list(client.extract([[1, 2]]))
    assert sleeps == [60.0, 60.0]  # capped at max_retry_after_s
    assert info.value.status_code == status and info.value.retry_after_s == 999


def test_x_should_retry_false_stops_retries_on_503():
    server = FakeServer(script=[Call(status=503, headers={"x-should-retry": "false"})])
    with make_client(server) as client, pytest.raises(ServiceUnavailableError):
        list(client.extract([[1]]))
    assert len(server.requests) == 1


@pytest.mark.parametrize(("status", "error"), [(400, BadRequestError), (401, AuthenticationError)])
def test_client_errors_are_not_retried(status, error):
    server = FakeServer(script=[Call(status=status, error_type="invalid_request")])
    sleeps: list[float] = []
    with make_client(server, sleeps) as client, pytest.raises(error, match=f"HTTP {status} invalid_request"):
        list(client.extract([[1, 2]]))
    assert len(server.requests) == 1 and sleeps == []


def test_backoff_grows_with_jitter_and_a_cap():
    client = ExtractionClient("http://fake", transport=FakeServer().transport())
    exc = APIConnectionError("x")
    delays = [client.retry_delay_s(exc, attempt) for attempt in range(8)]
    assert 0.375 <= delays[0] <= 0.5 and 0.75 <= delays[1] <= 1.0 and 12 <= delays[7] <= 16
    assert 12 <= client.retry_delay_s(exc, 5000) <= 16  # a long retry budget: capped, no float overflow


def test_sample_error_fails_that_sample_only():
    server = FakeServer(script=[Call(fail_ids=("b",))])
    samples = [{"id": i, "input_ids": [1, 2, 3]} for i in "abc"]
    with make_client(server) as client:
        got = []
        with pytest.raises(SampleFailedError, match="sample 'b' failed") as info:  # noqa: PT012
            for s in client.extract(samples):
                got.append(s.sample_id)
    assert got == ["a", "c"] and [f.sample_id for f in info.value.failures] == ["b"]
    assert len(server.requests) == 1
    with make_client(FakeServer(script=[Call(fail_ids=("b",))])) as client:
        assert [s.sample_id for s in client.extract(samples, on_sample_error="skip")] == ["a", "c"]


def test_retryable_sample_error_is_asked_again():
    server = FakeServer(script=[Call(fail_ids=("b",), fail_retryable=True)])
    samples = [{"id": i, "input_ids": [1, 2, 3]} for i in "abc"]
    with make_client(server) as client:
        assert [s.sample_id for s in client.extract(samples)] == ["a", "b", "c"]
    assert [r["id"] for r in server.requests[1]["samples"]] == ["b"]


def test_retryable_error_frame_resumes_and_fatal_one_raises():
    hiccup = {"type": "internal", "message": "engine hiccup", "retryable": True}
    server = FakeServer(script=[Call(abort=hiccup, truncate_after_samples=1)])
    with make_client(server) as client:
        assert [s.sample_id for s in client.extract([[1], [2]])] == ["0", "1"]
    assert [r["id"] for r in server.requests[1]["samples"]] == ["1"]
    server = FakeServer(script=[Call(abort={"type": "internal", "message": "engine died", "retryable": False})])
    with make_client(server) as client, pytest.raises(StreamError, match="engine died"):
        list(client.extract([[1], [2]]))


def test_multi_url_failover_when_one_server_refuses_connections():
    good = FakeServer()

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            raise httpx.ConnectError("connection refused", request=request)
        return good.handle(request)

    client = ExtractionClient(
        ["http://dead:1", "http://alive:2"], transport=httpx.MockTransport(handle), sleep=lambda s: None
    )
    assert client.info().model_id == "fake-llama"
    assert client.url == "http://alive:2"
    assert [s.sample_id for s in client.extract([[1, 2], [3]])] == ["0", "1"]
    dead_only = ExtractionClient("http://dead:1", transport=httpx.MockTransport(handle), sleep=lambda s: None,
                                 max_retries=1)  # fmt: skip
    with pytest.raises(APIConnectionError, match="connection refused"):
        dead_only.info()


def test_api_key_from_env_is_sent(monkeypatch):
    seen = []
    server = FakeServer(on_call=lambda body: None)
    inner = server.handle

    def handle(request):
        seen.append(request.headers.get("authorization"))
        return inner(request)

    monkeypatch.setenv("EAGLE3_API_KEY", "sekret")
    client = ExtractionClient("http://fake", transport=httpx.MockTransport(handle))
    list(client.extract([[1]]))
    assert seen == ["Bearer sekret", "Bearer sekret"]  # /v1/info (the request limits), then /v1/extract


def test_unordered_mode_yields_in_arrival_order():
    server = FakeServer()
    with make_client(server) as client:
        out = list(client.extract([[1], [2], [3]], ordered=False))
    assert sorted(s.sample_id for s in out) == ["0", "1", "2"]
