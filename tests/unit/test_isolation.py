"""Tenants of one server learn nothing of each other (docs/reliability.md, "Isolation"): a plain key
sees its own tenant's rows, errors and series only; an admin key sees all; ``--public-status`` shows
every tenant with error texts and request ids redacted; ``--cache-scope tenant`` gives no tenant a hit
on another's extraction (no counter, no latency to tell it); the disk cache is 0700/0600 and MACed, so
an entry planted with a recomputed checksum is never served; anonymous tenant names are bounded and
names starting with ``_`` (the server's own) refused."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from fastapi.testclient import TestClient

from eagle3.server.app import create_app
from eagle3.server.cache_disk import CacheSecretError, DiskTier
from eagle3.server.config import SettingsError
from eagle3.server.errors import ApiError
from eagle3.server.feature_cache import FeatureCache
from eagle3.server.tenants import AnonymousTenants
from tests.unit.test_feature_cache import HIDDEN, LAYERS, disk_cache, entry_files, stored
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


def planted(path: Path, checksum: Callable[[bytes], bytes]) -> torch.Tensor:
    """Edit the states of the entry at ``path`` (every value + 1) and recompute its trailing 16 bytes
    with ``checksum``, as a local user with write access could; returns the states planted."""
    data = bytearray(path.read_bytes())
    (head_len,) = struct.unpack_from("<I", data, 8)
    start = 12 + head_len
    n = 6 * LAYERS * HIDDEN  # float32 states of the 6-token sample
    states = np.frombuffer(bytes(data[start : start + 4 * n]), dtype="<f4") + 1
    data[start : start + 4 * n] = states.tobytes()
    data[-16:] = checksum(bytes(data[:-16]))
    path.write_bytes(bytes(data))
    return torch.from_numpy(states.copy()).view(6, LAYERS, HIDDEN)


@pytest.mark.parametrize(
    "checksum",
    [xxhash.xxh3_128_digest, lambda b: hashlib.blake2b(b, digest_size=16).digest()],
    ids=["xxh3", "blake2b-unkeyed"],
)
def test_a_planted_disk_entry_with_a_recomputed_checksum_is_not_served(
    tmp_path: Path, checksum: Callable[[bytes], bytes]
) -> None:
    ids = [5, 9, 2, 7, 7, 1]
    cache = disk_cache(tmp_path)
    stored(cache, ids, torch.float32)
    cache.close()
    (path,) = entry_files(tmp_path)
    forged = planted(path, checksum)

    fresh = disk_cache(tmp_path, memory_bytes=1 << 20)
    got = fresh.get(*fresh.key(ids))
    assert got is None or not torch.equal(got, forged), "the planted states were served"
    assert got is None and fresh.disk is not None and fresh.disk.stats.corrupt == 1 and not path.exists()
    fresh.close()


def test_cache_directories_are_0700_and_files_0600(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)  # the usual umask, under which plain mkdir/open give 0755/0644
    try:
        cache = disk_cache(tmp_path / "cache")
        stored(cache, [1, 2, 3])
        cache.close()
    finally:
        os.umask(old_umask)
    (entry,) = entry_files(tmp_path)
    made = [tmp_path / "cache", *(tmp_path / "cache").rglob("*")]
    for p in made:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    assert entry in made and len(made) == 5  # the dir, its layout dir, the secret, a key prefix dir, the entry


def test_a_cache_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    disk_cache(tmp_path).close()
    (secret,) = tmp_path.rglob("secret")
    secret.chmod(0o644)
    with pytest.raises(CacheSecretError, match=f"chmod 600 {secret}"):
        DiskTier(tmp_path, 1 << 20)


@pytest.mark.parametrize("public_openapi", [False, True])
def test_openapi_needs_a_key_unless_public_and_no_swagger_ui_from_a_cdn(tmp_path: Path, public_openapi: bool) -> None:
    with keyed(tmp_path, public_openapi=public_openapi) as client:
        wait_for(client, "ready")
        keyless = client.get("/openapi.json")
        keyed_spec = client.get("/openapi.json", headers=auth("bob")).json()
        docs = [client.get(path, headers=auth("bob")) for path in ("/docs", "/docs/oauth2-redirect", "/redoc")]
        page = client.get("/", headers=auth("bob")).text
    assert keyless.status_code == (200 if public_openapi else 401)
    if public_openapi:
        assert keyless.json() == keyed_spec
    assert "/v1/extract" in keyed_spec["paths"] and "/openapi.json" not in keyed_spec["paths"]
    assert [r.status_code for r in docs] == [404, 404, 404]
    assert not any("cdn" in r.text for r in docs) and 'href="/docs"' not in page


def anonymous_extract(client: TestClient, tenant: str, last_id: int = 9) -> int:
    body = {"samples": [{"id": "a", "input_ids": [7, 8, last_id]}]}
    return client.post("/v1/extract", json=body, headers={"X-Eagle3-Tenant": tenant}).status_code


def test_anonymous_tenants_are_bounded_least_recently_seen_idle_ones_forgotten(tmp_path: Path) -> None:
    names = [f"t{i:03d}" for i in range(70)]  # over the default --max-anonymous-tenants 64
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        for i, name in enumerate(names):
            assert anonymous_extract(client, name, last_id=100 + i) == 200  # no cache hits: each one computed
            bad = {"samples": [{"id": f"secret-{name}", "input_ids": [1] * 600}]}  # an error note per tenant
            assert client.post("/v1/extract", json=bad, headers={"X-Eagle3-Tenant": name}).status_code == 400
        text = client.get("/metrics", headers={"X-Eagle3-Tenant": names[-1]}).text
        status = client.get("/v1/status", headers={"X-Eagle3-Tenant": names[-1]}).json()
    kept = set(names[-64:])
    assert series_tenants(text) == {*kept, "_pruned"}  # the 6 forgotten ones' counts, summed
    assert {t["tenant"] for t in status["tenants"]} == {*kept, "_pruned"}
    assert {e["tenant"] for e in status["recent_errors"]} <= kept
    pruned = samples_of(text)[("eagle3_requests_total", (("tenant", "_pruned"),))]
    assert pruned == 6 and status["tokens_extracted"] == 3 * len(names)  # totals keep everyone's work


def test_a_full_set_of_busy_anonymous_tenants_refuses_a_new_name_and_recency_counts() -> None:
    seen = AnonymousTenants(2)
    assert seen.admit("a", lambda t: True) == [] and seen.admit("b", lambda t: True) == []
    with pytest.raises(ApiError) as err:
        seen.admit("c", lambda t: True)
    assert (err.value.status, err.value.reason) == (429, "too_many_tenants")
    assert seen.admit("a", lambda t: True) == []  # a known name is never refused; "a" is now the most recent
    assert seen.admit("c", lambda t: t == "a") == ["b"]
    assert seen.admit("d", lambda t: t != "a") == ["a"]  # the least recent busy one is skipped, not forgotten
    assert len(seen) == 2


def test_reserved_tenant_names_are_refused_and_cannot_hide_request_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        caplog.clear()
        with caplog.at_level("DEBUG", logger="eagle3.server.requests"):
            statuses = [anonymous_extract(client, name) for name in ("_warmup", "_x", "ok_name")]
    assert statuses == [400, 400, 200]
    info_lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert sum("POST /v1/extract 400" in line for line in info_lines) == 2, info_lines
    assert sum("extract finished" in line and "tenant=ok_name" in line for line in info_lines) == 1, info_lines
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("alice: k1\n_warmup: k2\n")
    with pytest.raises(SettingsError, match="'_warmup': names starting with '_' are reserved"):
        settings(api_keys_file=str(keys_file))
