"""The SDK's last metre (issue 30 item 9, openai-python as the bar): token ids without a loss mask warn
once (their features train on nothing); a features directory is a ``DataLoader``-ready dataset; a call
of ``extract`` takes its own ``timeout_s``; one sample over the request cap is told what to do (it cannot
be split into several requests). Error classes importable from ``eagle3`` and ``-v`` after a subcommand:
tests/unit/test_error_root.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch.utils.data import DataLoader

import eagle3.client.request_samples as request_samples
from eagle3 import ExtractionClient, FeaturesDataset
from eagle3.client.request_samples import MaskMissingWarning, to_request_samples
from eagle3.core.features_reader import FeaturesReader
from eagle3.server.app import create_app
from tests.unit.sdk_fake import FakeServer
from tests.unit.test_features_writer import sample, write
from tests.unit.test_server_app import FakeBackend, settings, wait_for


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_samples, "_warned_no_mask", False)


def test_token_ids_without_a_mask_warn_once(fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the once is ours, not the warnings filter's
        to_request_samples([[1, 2, 3], {"input_ids": [4, 5]}])
        to_request_samples([[6, 7]])
    assert [w.category for w in caught] == [MaskMissingWarning], [str(w.message) for w in caught]
    assert "without a loss_mask" in str(caught[0].message) and "learns nothing" in str(caught[0].message)


def test_masked_chat_and_prepared_samples_do_not_warn(fresh_warning: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_request_samples([{"input_ids": [1, 2], "loss_mask": [0, 1]}, [{"role": "user", "content": "hi"}]])


def test_the_warning_points_at_the_notebooks_line(fresh_warning: None, tmp_path: Path) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as http:
        wait_for(http, "ready")
        client = ExtractionClient("http://testserver", http_client=http)  # type: ignore[arg-type]
        with pytest.warns(MaskMissingWarning) as caught:
            got = list(client.extract([[5, 6, 7]]))
        assert got[0].loss_mask.tolist() == [0, 0, 0]
    assert caught[0].filename == __file__


def features_dir(tmp_path: Path) -> tuple[Path, list[Any]]:
    samples = [sample(i) for i in range(9)]
    write(tmp_path / "features", samples)
    return tmp_path / "features", samples


def test_features_dataset_items_are_the_readers_samples_as_tensors(tmp_path: Path) -> None:
    root, samples = features_dir(tmp_path)
    data = FeaturesDataset(root)
    reader = FeaturesReader(root)
    assert len(data) == len(reader) == 9 and data.aux_layer_ids == tuple(reader.meta.aux_layer_ids)
    item = data[4]
    want = reader["s4"]
    assert item["sample_id"] == "s4" and item["input_ids"].dtype == torch.int64
    assert (
        item["input_ids"].tolist() == want.input_ids.tolist() and item["loss_mask"].tolist() == want.loss_mask.tolist()
    )
    assert item["hidden_states"].dtype == torch.bfloat16
    np.testing.assert_array_equal(item["hidden_states"].float().numpy(), want.hidden_states)
    subset = FeaturesDataset(root, sample_ids=["s8", "s0"])
    assert [subset[i]["sample_id"] for i in range(len(subset))] == ["s8", "s0"]
    with pytest.raises(KeyError, match="'nope'"):
        FeaturesDataset(root, sample_ids=["s1", "nope"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataloader_batches_padded_samples_in_worker_processes(tmp_path: Path, num_workers: int) -> None:
    root, samples = features_dir(tmp_path)
    loader = DataLoader(
        FeaturesDataset(root), batch_size=4, num_workers=num_workers, collate_fn=FeaturesDataset.pad_collate
    )
    batches = list(loader)
    assert [len(b["sample_ids"]) for b in batches] == [4, 4, 1]
    reader = FeaturesReader(root)
    for batch in batches:
        longest = max(len(reader[s].input_ids) for s in batch["sample_ids"])
        assert batch["hidden_states"].shape == (len(batch["sample_ids"]), longest, 3, 16)
        for row, sample_id in enumerate(batch["sample_ids"]):
            want = reader[sample_id]
            n = len(want.input_ids)
            assert batch["attention_mask"][row].tolist() == [True] * n + [False] * (longest - n)
            assert batch["input_ids"][row, :n].tolist() == want.input_ids.tolist()
            assert batch["loss_mask"][row, :n].tolist() == want.loss_mask.tolist()
            assert not batch["loss_mask"][row, n:].any() and not batch["hidden_states"][row, n:].float().any()
            np.testing.assert_array_equal(batch["hidden_states"][row, :n].float().numpy(), want.hidden_states)


def test_extract_takes_a_timeout_per_call() -> None:
    server = FakeServer()
    seen: list[float | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/extract":
            seen.append(request.extensions["timeout"]["read"])
        return server.handle(request)

    transport = httpx.MockTransport(handle)
    with ExtractionClient("http://fake", timeout_s=120.0, transport=transport) as client:
        list(client.extract([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}]))
        list(client.extract([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}], timeout_s=2.5))
        list(client.extract_stream([{"input_ids": [4], "loss_mask": [1]}], timeout_s=7.0))
        with pytest.raises(ValueError, match="timeout_s must be > 0"):
            client.extract([{"input_ids": [1], "loss_mask": [1]}], timeout_s=0)
    assert seen == [120.0, 2.5, 7.0]


def test_one_sample_over_the_request_cap_is_told_what_to_do(tmp_path: Path) -> None:
    with TestClient(create_app(settings(max_request_tokens=100), FakeBackend(tmp_path))) as http:
        wait_for(http, "ready")
        one = http.post("/v1/extract", json={"samples": [{"id": "long", "input_ids": [5] * 150}]})
        two = http.post("/v1/extract", json={"samples": [{"id": f"s{i}", "input_ids": [5] * 60} for i in range(2)]})
    assert one.status_code == 400 and "split it into several requests" not in one.text
    message = one.json()["error"]["message"]
    assert "'long' has 150 tokens" in message and "truncate it to at most 100 tokens" in message, message
    assert "--max-request-tokens" in message
    assert two.status_code == 400 and "split it into several requests" in two.json()["error"]["message"]
