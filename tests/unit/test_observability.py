"""What an operator sees of a shared server: /metrics parsed by prometheus_client (a hostile tenant
name cannot break it), per-tenant counters and latency histograms, what needs a key and what not
(--public-metrics, --public-status), OpenAPI, one log line per finished request (probes silent, JSON
when asked), a public bind refused without keys, and /readyz's expected load time from the last load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from eagle3.core.json_log import JsonFormatter
from eagle3.core.protocol.frames import FrameDecoder, FrameType
from eagle3.server.app import create_app
from eagle3.server.config import ServerSettings, SettingsError
from eagle3.server.load_history import expected_load_s, load_key, record_load_s
from eagle3.server.runtime import Runtime
from tests.unit.test_server_app import FakeBackend, settings, wait_for

HOSTILE = 'team "a"\nfake_metric{x="1"} 99 \\'


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def frames(content: bytes) -> list[FrameType]:
    decoder = FrameDecoder()
    out = [f.type for f in decoder.feed(content)]
    decoder.close()
    return out


@pytest.fixture
def keyed_app(tmp_path: Path) -> tuple[TestClient, dict[str, str]]:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({HOSTILE: "key-hostile", "ops": "key-ops"}))
    app = create_app(settings(api_keys_file=str(keys_file), admin_tenant=("ops",)), FakeBackend(tmp_path))
    return TestClient(app), {"hostile": "Bearer key-hostile", "ops": "Bearer key-ops"}


def test_exposition_with_a_hostile_tenant_parses_and_counts_per_tenant(
    keyed_app: tuple[TestClient, dict[str, str]],
) -> None:
    client, auth = keyed_app
    with client:
        wait_for(client, "ready")
        body = {
            "samples": [{"id": "a", "input_ids": [5, 6, 7]}, {"id": "b", "input_ids": [8, 9]}],
            "codec": "zstd+planes",
        }
        resp = client.post("/v1/extract", json=body, headers={"Authorization": auth["hostile"]})
        assert frames(resp.content)[-1] == FrameType.END
        too_big = {"samples": [{"id": "c", "input_ids": [1] * 600}]}  # over max_model_len 512: a 400, not counted
        assert client.post("/v1/extract", json=too_big, headers={"Authorization": auth["hostile"]}).status_code == 400
        text = client.get("/metrics", headers={"Authorization": auth["ops"]}).text

    got = samples_of(text)  # raises on a malformed exposition
    tenant = (("tenant", HOSTILE),)
    assert got[("eagle3_requests_total", tenant)] == 1
    assert got[("eagle3_tokens_extracted_total", tenant)] == 5
    assert got[("eagle3_samples_total", (("outcome", "ok"), *tenant))] == 2
    wire = got[("eagle3_stream_bytes_total", (("kind", "wire"), *tenant))]
    assert 0 < wire < got[("eagle3_stream_bytes_total", (("kind", "raw"), *tenant))]
    assert not any(name == "fake_metric" for name, _ in got), "the tenant name injected a series"
    lane = (("lane", "interactive"),)  # 5 tokens: a small request (server/lanes.py)
    for hist, labels in (
        ("eagle3_queue_wait_seconds", ()),
        ("eagle3_time_to_first_sample_seconds", lane),
        ("eagle3_request_duration_seconds", ()),
    ):
        assert got[(f"{hist}_count", labels)] == 1, hist
        assert got[(f"{hist}_bucket", tuple(sorted((("le", "+Inf"), *labels))))] == 1
        assert got[(f"{hist}_sum", labels)] > 0
    assert got[("eagle3_batch_fill_ratio_count", ())] >= 1


def test_a_rejection_is_counted_for_its_tenant(keyed_app: tuple[TestClient, dict[str, str]]) -> None:
    client, auth = keyed_app
    with client:
        wait_for(client, "ready")
        big = b'{"samples": [' + b" " * (65 << 20) + b"]}"
        headers = {"Authorization": auth["ops"], "Content-Type": "application/json"}
        assert client.post("/v1/extract", content=big, headers=headers).status_code == 413
        text = client.get("/metrics", headers={"Authorization": auth["ops"]}).text
        status = client.get("/v1/status", headers={"Authorization": auth["ops"]}).json()
    assert samples_of(text)[("eagle3_rejections_total", (("reason", "payload_too_large"), ("tenant", "ops")))] == 1
    assert [e["kind"] for e in status["recent_errors"]] == ["payload_too_large"]
    assert {t["tenant"]: t["rejections"] for t in status["tenants"]} == {"ops": 1}


@pytest.mark.parametrize(("public_metrics", "public_status"), [(False, False), (True, False), (False, True)])
def test_what_needs_a_key(tmp_path: Path, public_metrics: bool, public_status: bool) -> None:
    s = settings(api_key=("k",), public_metrics=public_metrics, public_status=public_status)
    with TestClient(create_app(s, FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        assert client.get("/metrics").status_code == (200 if public_metrics else 401)
        assert client.get("/").status_code == (200 if public_status else 401)
        assert client.get("/v1/status").status_code == (200 if public_status else 401)
        assert client.get("/v1/info").status_code == 401  # never public
        assert client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [1]}]}).status_code == 401
        ok = {"Authorization": "Bearer k"}
        assert client.get("/metrics", headers=ok).status_code == 200
        assert client.get("/", headers=ok).status_code == 200


def test_openapi_describes_extract(tmp_path: Path) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/extract"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ExtractRequest"}
    schemas = spec["components"]["schemas"]
    assert {"ExtractRequest", "SampleIn", "MessageIn"} <= set(schemas)
    assert set(schemas["ExtractRequest"]["properties"]) == {"samples", "codec", "zstd_level", "cache", "dtype"}
    assert any(t.startswith("application/x-eagle3-frames") for t in op["responses"]["200"]["content"])
    assert {"/livez", "/readyz", "/v1/info", "/v1/status"} <= set(spec["paths"])


def test_one_log_line_per_finished_request_and_none_for_probes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eagle3.server.requests"):
            for _ in range(3):
                client.get("/livez")
                client.get("/readyz")
            resp = client.post("/v1/extract", json={"samples": [{"id": "a", "input_ids": [5, 6, 7]}]},
                               headers={"X-Request-Id": "req-42", "X-Eagle3-Tenant": "alice"})  # fmt: skip
            assert resp.status_code == 200
            client.get("/v1/info")
    records = [r for r in caplog.records if r.name == "eagle3.server.requests" and r.levelno >= logging.INFO]
    assert len(records) == 2, [r.getMessage() for r in records]
    done, info = records
    fields = done.__dict__["fields"]
    assert fields["request_id"] == "req-42" and fields["tenant"] == "alice" and fields["outcome"] == "ok"
    assert (fields["samples"], fields["failed"], fields["tokens"]) == (1, 0, 3) and fields["bytes"] > 0
    assert fields["duration_s"] >= 0
    assert "request_id=req-42 tenant=alice samples=1" in done.getMessage()
    assert info.getMessage().startswith("GET /v1/info 200")
    line = json.loads(JsonFormatter().format(done))
    assert line["level"] == "info" and line["logger"] == "eagle3.server.requests" and line["tokens"] == 3
    assert line["ts"].endswith("+00:00")


def test_a_public_bind_without_keys_is_refused_unless_anonymous_is_allowed() -> None:
    with pytest.raises(SettingsError, match="--allow-anonymous"):
        ServerSettings(host="0.0.0.0")
    with pytest.raises(SettingsError, match="no API key"):
        ServerSettings(host="10.1.2.3")
    ServerSettings(host="0.0.0.0", allow_anonymous=True)
    ServerSettings(host="0.0.0.0", api_key=("secret",))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        ServerSettings(host=host)


def test_readyz_expects_the_last_load_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    key = load_key("/models/x", "vllm", 8, "bfloat16")
    assert expected_load_s(key) is None
    record_load_s(key, 1320.44)
    assert expected_load_s(key) == 1320.4
    assert expected_load_s(load_key("/models/x", "vllm", 4, "bfloat16")) is None  # another TP: no guess
    s = ServerSettings(model="/models/x", backend="vllm", tensor_parallel_size=8)
    estimate = Runtime(s).load_estimate()  # not started: loading
    assert estimate["expected_s"] == 1320.4 and 1319 < estimate["eta_s"] <= 1320.4
    (tmp_path / "cache" / "load-times.json").write_text("{not json")
    assert expected_load_s(key) is None  # a damaged file is no estimate, never an error
