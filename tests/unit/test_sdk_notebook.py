"""The SDK as a notebook uses it, against the real app (FakeBackend) through an injected
``http_client`` (a ``TestClient``): ``EAGLE3_SERVER_URL``, ``extract()`` of twice the server's
request cap split into requests under it, bf16 states as a zero-copy torch tensor, the explicit loss
mask default; and the features directory lock that keeps two ``eagle3 extract`` runs into the same
``--out`` from deleting each other's shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from eagle3.client.sdk import DEFAULT_LOSS_MASK, SERVER_URL_ENV, ExtractionClient
from eagle3.core.errors import FeaturesLockedError
from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import SHARDS_DIR
from eagle3.server.app import create_app
from tests.unit.test_features_writer import META, sample
from tests.unit.test_server_app import FakeBackend, settings, wait_for

CAP = 300  # --max-request-tokens of the app below


@pytest.fixture
def app_client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(settings(max_request_tokens=CAP), FakeBackend(tmp_path)))


def test_extract_twice_the_servers_cap_in_requests_under_it(
    app_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SERVER_URL_ENV, "http://testserver")
    rng = np.random.default_rng(0)
    samples = [rng.integers(1, 999, 60).tolist() for _ in range(10)]  # 600 tokens = 2 x CAP
    with app_client as http:
        wait_for(http, "ready")
        client = ExtractionClient(http_client=http)  # type: ignore[arg-type]  # URL from EAGLE3_SERVER_URL
        assert client.urls == ["http://testserver"]
        got = list(client.extract(samples))
        client.close()
        assert http.get("/livez").status_code == 200, "close() must leave an injected client open"
        metrics = http.app.state.runtime.metrics  # type: ignore[attr-defined]
        n_requests = metrics.get("eagle3_requests_total")
        whole = {"samples": [{"id": str(i), "input_ids": ids} for i, ids in enumerate(samples)]}
        assert http.post("/v1/extract", json=whole).status_code == 400  # in one request: over the cap
    assert [s.sample_id for s in got] == [str(i) for i in range(10)]
    assert n_requests == 2  # 5 + 5 samples of 60 tokens: two requests of exactly CAP tokens
    for item, ids in zip(got, samples, strict=True):
        assert item.input_ids.tolist() == ids
        assert item.loss_mask.tolist() == [DEFAULT_LOSS_MASK] * len(ids) == [0] * len(ids)
        states = item.as_torch()
        assert states.dtype == torch.bfloat16 and tuple(states.shape) == item.hidden_states_bf16.shape
        assert states.untyped_storage().data_ptr() == item.hidden_states_bf16.ctypes.data  # no copy
        np.testing.assert_array_equal(states.float().numpy(), item.hidden_states)
        real = item.as_bfloat16()  # numpy bf16 (ml_dtypes), same memory, no torch needed
        assert real.dtype.name == "bfloat16" and np.shares_memory(real, item.hidden_states_bf16)
        np.testing.assert_array_equal(real.astype(np.float32), item.hidden_states)


def test_a_missing_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SERVER_URL_ENV, raising=False)
    with pytest.raises(ValueError, match=SERVER_URL_ENV):
        ExtractionClient()
    monkeypatch.setenv(SERVER_URL_ENV, "http://a:8000/, http://b:8000")
    assert ExtractionClient().urls == ["http://a:8000", "http://b:8000"]


def test_two_writers_into_one_directory_cannot_delete_each_others_shards(tmp_path: Path) -> None:
    first = FeaturesWriter.open(tmp_path / "features", META, shard_mb=1)
    first.add(sample(0))
    in_flight = tmp_path / "features" / SHARDS_DIR / "shard-000001-inflight.safetensors.tmp"
    in_flight.write_bytes(b"half a shard")  # what the first writer is writing right now
    with pytest.raises(FeaturesLockedError, match="another process"):
        FeaturesWriter.open(tmp_path / "features", META, shard_mb=1)
    assert in_flight.exists(), "the refused writer must not have cleaned up the first one's shard"
    in_flight.unlink()
    first.close()
    second = FeaturesWriter.open(tmp_path / "features", META, shard_mb=1)  # unlocked: resume works
    assert second.done_ids == {sample(0).sample_id}
    second.close()
