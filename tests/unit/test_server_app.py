"""The app in-process with a fake backend: the load's warm-up takes the real request path (scheduler
thread, packing, every codec, frames decoded back) and leaves no trace in the metrics; a backend whose
output is wrong fails the load instead of the first request; per-request buffers are sized in bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from eagle3.core.protocol.frames import FrameDecoder, FrameType
from eagle3.server.app import create_app
from eagle3.server.backends import BackendInfo
from eagle3.server.config import ServerSettings
from eagle3.server.request_state import request_buffer_tokens

HIDDEN, N_LAYERS, AUX = 8, 6, (2, 3, 3)


class FakeBackend:
    """States are a pure function of the ids; records each call's lengths and thread."""

    name = "fake"

    def __init__(self, model_dir: Path, bad_shape: bool = False) -> None:
        self.model_dir = model_dir
        self.bad_shape = bad_shape
        self.calls: list[tuple[str, list[int]]] = []

    def load(self, progress: object) -> BackendInfo:
        return BackendInfo(
            model_id="fake",
            revision="r" * 64,
            model_dir=str(self.model_dir),
            num_hidden_layers=N_LAYERS,
            hidden_size=HIDDEN,
            vocab_size=1000,
            max_model_len=512,
            dtype="float32",
            aux_layer_ids=AUX,
            tokenizer_sha256="t" * 64,
            backend=self.name,
            device="cpu",
        )

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self.calls.append((threading.current_thread().name, [len(ids) for ids in batch]))
        out = []
        for ids in batch:
            base = torch.tensor(ids, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
            n_out = len(AUX) + (0 if self.bad_shape else 1)
            out.append(base + torch.arange(n_out * HIDDEN, dtype=torch.float32).view(1, n_out, HIDDEN))
        return out  # each [n, L+1, H]

    def close(self) -> None:
        pass


def wait_for(client: TestClient, status: str) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = client.get("/readyz").json()
        if body["status"] == status:
            return dict(body)
        time.sleep(0.02)
    raise AssertionError(f"never {status}: {body}")


def settings(**kwargs: object) -> ServerSettings:
    return ServerSettings(backend="hf", max_batch_tokens=256, heartbeat_s=0.2, **kwargs)  # type: ignore[arg-type]


def test_warm_up_runs_the_request_path_then_the_metrics_start_at_zero(tmp_path: Path) -> None:
    backend = FakeBackend(tmp_path)
    app = create_app(settings(), backend)
    with TestClient(app) as client:
        wait_for(client, "ready")
        threads = {thread for thread, _ in backend.calls}
        assert threads == {"eagle3-scheduler"}, "warm-up must go through the scheduler's worker thread"
        lengths = sorted({n for _, call in backend.calls for n in call})
        assert lengths[0] == 1 and lengths[-1] == 256 and len(lengths) >= 4, lengths  # capped at max_batch_tokens
        assert any(len(call) > 1 for _, call in backend.calls), "no packed warm-up pass"
        metrics = client.get("/metrics").text
        assert "\neagle3_forward_passes_total 0.0\n" in metrics
        for name in ("eagle3_tokens_extracted_total", "eagle3_requests_total", "eagle3_queue_wait_seconds_count"):
            assert app.state.runtime.metrics.get(name) == 0, name
        assert 'tenant="_warmup"' not in metrics
        rt = app.state.runtime
        assert rt.scheduler.inflight_tokens == 0 and rt.scheduler.n_requests == 0
        n_calls = len(backend.calls)

        resp = client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [5, 6, 7]}]})
        decoder = FrameDecoder()
        frames = decoder.feed(resp.content)
        decoder.close()
        assert [f.type for f in frames] == [FrameType.HEADER, FrameType.DATA, FrameType.END]
        assert backend.calls[n_calls:] == [("eagle3-scheduler", [3])]
        assert '\neagle3_tokens_extracted_total{tenant="default"} 3.0\n' in client.get("/metrics").text


def test_a_backend_whose_output_is_wrong_fails_the_load_not_the_first_request(tmp_path: Path) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path, bad_shape=True))) as client:
        body = wait_for(client, "failed")
        assert "warm" in str(body["phase"]).lower() or "shape" in str(body["phase"]).lower(), body
        resp = client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]})
        assert resp.status_code == 503 and resp.json()["error"]["reason"] == "failed"


@pytest.mark.parametrize(
    ("bytes_per_token", "buffer_bytes", "expected"),
    [
        (4 * 576 * 2, 256 << 20, 2 * 8192),  # SmolLM2 bf16: two passes fit in 256 MiB
        (4 * 8192 * 2, 256 << 20, 8192),  # a 70B-class hidden size: capped by bytes, floored at one pass
        (4 * 4096 * 2, 256 << 20, 8192),
        (4 * 2048 * 2, 256 << 20, 2 * 8192),
        (4 * 3072 * 2, 256 << 20, (256 << 20) // (4 * 3072 * 2)),  # between one and two passes
    ],
)
def test_request_buffer_is_two_passes_capped_in_bytes(bytes_per_token: int, buffer_bytes: int, expected: int) -> None:
    assert request_buffer_tokens(8192, bytes_per_token, buffer_bytes) == expected


class BlockingBackend(FakeBackend):
    """Extract calls after ``block()`` wait until ``release()``: a request stays in flight."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self.entered.set()
        assert self.gate.wait(30)
        return super().extract(batch)


def test_a_tenant_over_its_quota_is_counted_once(tmp_path: Path) -> None:
    backend = BlockingBackend(tmp_path)
    app = create_app(settings(max_tenant_inflight_tokens=300), backend)
    with TestClient(app) as client:
        wait_for(client, "ready")
        backend.gate.clear()
        backend.entered.clear()
        first: list[int] = []
        body = {"samples": [{"id": "a", "input_ids": [5] * 200}]}
        worker = threading.Thread(target=lambda: first.append(client.post("/v1/extract", json=body).status_code))
        worker.start()
        assert backend.entered.wait(30)  # 200 tokens of the tenant are in flight
        resp = client.post("/v1/extract", json={"samples": [{"id": "b", "input_ids": [6] * 200}]})
        assert resp.status_code == 429 and resp.json()["error"]["reason"] == "tenant_quota"
        backend.gate.set()
        worker.join(30)
        assert first == [200]
        metrics = client.get("/metrics").text
        assert '\neagle3_rejections_total{reason="tenant_quota",tenant="default"} 1.0\n' in metrics, metrics
