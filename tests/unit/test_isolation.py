"""Tenants of one server learn nothing of each other (docs/reliability.md, "Isolation"): a plain key
sees its own tenant's rows, errors and series only; an admin key sees all; ``--public-status`` shows
every tenant with error texts and request ids redacted; ``--cache-scope tenant`` gives no tenant a hit
on another's extraction (no counter, no latency to tell it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from eagle3.server.app import create_app
from eagle3.server.config import SettingsError
from eagle3.server.feature_cache import FeatureCache
from tests.unit.test_observability import frames, samples_of
from tests.unit.test_server_app import FakeBackend, settings, wait_for

SECRET_ID = "alice-private-doc-7"  # a sample id that is content: it must not reach another tenant
KEYS = {"alice": "key-a", "bob": "key-b", "ops": "key-ops"}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def keyed(tmp_path: Path, **kwargs: object) -> TestClient:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    return TestClient(create_app(settings(api_keys_file=str(keys_file), **kwargs), FakeBackend(tmp_path)))


def alice_works_and_fails(client: TestClient) -> None:
    """alice: one extract that succeeds (rows, a cache entry) and one refused naming her sample id."""
    ok = {"samples": [{"id": "a", "input_ids": [5, 6, 7]}]}
    assert frames(client.post("/v1/extract", json=ok, headers=auth("alice")).content)[-1].name == "END"
    bad = {"samples": [{"id": SECRET_ID, "input_ids": [1] * 600}]}  # over max_model_len 512
    resp = client.post("/v1/extract", json=bad, headers=auth("alice"))
    assert resp.status_code == 400 and SECRET_ID in resp.text  # alice herself is told which sample


def series_tenants(text: str) -> set[str]:
    return {dict(labels)["tenant"] for (_, labels) in samples_of(text) if "tenant" in dict(labels)}


def test_a_plain_key_sees_only_its_own_tenant(tmp_path: Path) -> None:
    with keyed(tmp_path) as client:
        wait_for(client, "ready")
        alice_works_and_fails(client)
        bob_status = client.get("/v1/status", headers=auth("bob")).json()
        bob_page = client.get("/", headers=auth("bob")).text
        bob_metrics = client.get("/metrics", headers=auth("bob")).text
        alice_status = client.get("/v1/status", headers=auth("alice")).json()
        alice_metrics = client.get("/metrics", headers=auth("alice")).text

    assert SECRET_ID not in json.dumps(bob_status) and SECRET_ID not in bob_page and "alice" not in bob_page
    assert bob_status["tenants"] == [] and bob_status["recent_errors"] == []
    assert series_tenants(bob_metrics) == set() and "eagle3_cache_" not in bob_metrics
    assert "eagle3_forward_passes_total" in bob_metrics  # server-wide figures stay
    assert bob_status["tokens_extracted"] == 3  # ... and so do server-wide totals

    assert [t["tenant"] for t in alice_status["tenants"]] == ["alice"]
    assert any(SECRET_ID in e["message"] for e in alice_status["recent_errors"])  # her own, whole
    assert series_tenants(alice_metrics) == {"alice"} and "eagle3_cache_" not in alice_metrics


def test_an_admin_key_sees_every_tenant(tmp_path: Path) -> None:
    with keyed(tmp_path, admin_tenant=("ops",)) as client:
        wait_for(client, "ready")
        alice_works_and_fails(client)
        ops_status = client.get("/v1/status", headers=auth("ops")).json()
        ops_metrics = client.get("/metrics", headers=auth("ops")).text

    assert [t["tenant"] for t in ops_status["tenants"]] == ["alice"]
    assert any(SECRET_ID in e["message"] for e in ops_status["recent_errors"])
    assert series_tenants(ops_metrics) == {"alice"}
    assert samples_of(ops_metrics)[("eagle3_cache_misses_total", ())] == 1


def test_the_public_status_page_redacts_error_texts_and_request_ids(tmp_path: Path) -> None:
    with keyed(tmp_path, public_status=True) as client:
        wait_for(client, "ready")
        alice_works_and_fails(client)
        public = client.get("/v1/status").json()
        page = client.get("/").text
        alice = client.get("/v1/status", headers=auth("alice")).json()  # a key on a public page
        wrong = client.get("/v1/status", headers={"Authorization": "Bearer wrong"}).status_code

    assert [t["tenant"] for t in public["tenants"]] == ["alice"]  # public: every tenant's rows
    (err,) = public["recent_errors"]
    assert err["tenant"] == "alice" and err["kind"] == "invalid_request" and err["request_id"] == "-"
    assert SECRET_ID not in json.dumps(public) and SECRET_ID not in page
    assert SECRET_ID in alice["recent_errors"][0]["message"]
    assert wrong == 401  # a wrong key is refused even where the page is public


def test_cache_scope_tenant_gives_no_tenant_a_hit_on_another_ones_sample(tmp_path: Path) -> None:
    for scope, computed_by_bob in (("shared", 0), ("tenant", 1)):
        backend = FakeBackend(tmp_path)
        keys_file = tmp_path / "keys.json"
        keys_file.write_text(json.dumps(KEYS))
        s = settings(api_keys_file=str(keys_file), cache_scope=scope, admin_tenant=("ops",))
        with TestClient(create_app(s, backend)) as client:
            wait_for(client, "ready")
            body = {"samples": [{"id": "x", "input_ids": [11, 12, 13, 14]}]}
            client.post("/v1/extract", json=body, headers=auth("alice"))
            before = len(backend.calls)
            bob = client.post("/v1/extract", json=body, headers=auth("bob"))
            assert frames(bob.content)[-1].name == "END"
            again = client.post("/v1/extract", json=body, headers=auth("bob"))  # bob's own entry: a hit
            assert frames(again.content)[-1].name == "END"
            got = samples_of(client.get("/metrics", headers=auth("ops")).text)
        assert len(backend.calls) - before == computed_by_bob, scope
        assert got[("eagle3_cache_hits_total", (("tier", "memory"),))] == 2 - computed_by_bob, scope


def test_per_tenant_keys_differ_only_per_tenant() -> None:
    ids = [3, 1, 4, 1, 5]
    shared, scoped = FeatureCache(b"n" * 16, 1 << 20), FeatureCache(b"n" * 16, 1 << 20, per_tenant=True)
    assert shared.key(ids, "a")[0] == shared.key(ids, "b")[0] == shared.key(ids)[0]
    assert scoped.key(ids, "a")[0] != scoped.key(ids, "b")[0]
    assert scoped.key(ids, "a")[0] == scoped.key(ids, "a")[0]
    assert scoped.key(ids, "ab")[0] != scoped.key(ids, "a")[0]
    assert np.array_equal(scoped.key(ids, "a")[1], np.asarray(ids, dtype="<i4"))


def test_admin_tenants_must_be_tenants_of_the_keys(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="--admin-tenant 'root': no API key names that tenant"):
        settings(api_key=("k",), admin_tenant=("root",))
