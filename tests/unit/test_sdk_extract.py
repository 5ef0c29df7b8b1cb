"""extract_dataset against scripted servers (httpx.MockTransport): resume, failover, checks before work."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from eagle3.cli import main
from eagle3.client.errors import (
    FeaturesWriteError,
    IncompatibleError,
    InsufficientDiskError,
    NoServerAvailableError,
)
from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.core.features_reader import FeaturesReader
from eagle3.core.protocol import PreparedMeta, PreparedSample
from eagle3.core.protocol.features import MANIFEST_FILE, SHARDS_DIR, iter_manifest
from tests.unit.sdk_fake import TOKENIZER_SHA, Call, FakeServer, expected_hidden

N_SAMPLES = 12


def make_prepared(path, n=N_SAMPLES, tokenizer=TOKENIZER_SHA, vocab=256, lengths=None):
    path.mkdir()
    rows = []
    for i in range(n):
        length = lengths[i] if lengths else 5 + (i * 7) % 23
        ids = [(i * 13 + t * 5) % 250 + 1 for t in range(length)]
        rows.append(PreparedSample(f"row-{i}", ids, [t % 2 for t in range(length)], f"in.jsonl:{i + 1}"))
    (path / "samples.jsonl").write_text("".join(r.to_json() + "\n" for r in rows))
    meta = PreparedMeta("fake", "/m", tokenizer, "c" * 64, vocab, 4096, "drop", ["in.jsonl"])
    (path / "meta.json").write_text(meta.to_json())
    return rows


def requested_ids(server: FakeServer) -> list[str]:
    return [s["id"] for body in server.requests for s in body["samples"]]


def run(prepared, out, urls, transport, **config):
    config.setdefault("progress", False)
    return extract_dataset(
        prepared, out, urls, config=ExtractConfig(**config), transport=transport, sleep=lambda s: None
    )


def assert_features_equal(out, rows):
    reader = FeaturesReader(out, verify=True)
    assert sorted(reader.sample_ids) == sorted(r.sample_id for r in rows)
    for row in rows:
        got = reader[row.sample_id]
        assert got.input_ids.tolist() == row.input_ids and got.loss_mask.tolist() == row.loss_mask
        np.testing.assert_array_equal(got.hidden_states_bf16, expected_hidden(row.input_ids))


def test_extract_writes_every_sample_in_bounded_requests(tmp_path):
    rows = make_prepared(tmp_path / "prep")
    server = FakeServer()
    summary = run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport(), request_tokens=40)
    assert_features_equal(tmp_path / "out", rows)
    by_id = {r.sample_id: r.n_tokens for r in rows}
    for body in server.requests:
        assert sum(by_id[s["id"]] for s in body["samples"]) <= 40 or len(body["samples"]) == 1
        assert all(s["loss_mask"] == rows[int(s["id"].split("-")[1])].loss_mask for s in body["samples"])
    assert sorted(requested_ids(server)) == sorted(by_id)
    assert summary.n_samples == N_SAMPLES and summary.n_tokens == sum(by_id.values())
    assert summary.n_skipped == 0 and summary.n_failed == 0
    assert summary.bytes_on_disk == summary.bytes_written > 0 and summary.wire_bytes > 0
    assert "12 extracted" in summary.format_text()
    meta = json.loads((tmp_path / "out" / "features.json").read_text())
    assert meta["model_id"] == "fake-llama" and meta["n_samples_total"] == N_SAMPLES


def test_resume_requests_only_missing_samples(tmp_path):
    rows = make_prepared(tmp_path / "prep")
    first = FakeServer()
    run(tmp_path / "prep", tmp_path / "out", "http://a", first.transport(), limit=5, shard_mb=1)
    assert sorted(requested_ids(first)) == sorted(r.sample_id for r in rows[:5])
    # a crash later left an orphan shard, a temp file and a torn manifest line
    shards = tmp_path / "out" / SHARDS_DIR
    (shards / "shard-000007-feedface.safetensors").write_bytes(b"renamed but never recorded")
    (shards / ".shard-000008-x.safetensors.abcd.tmp").write_bytes(b"half")
    with open(tmp_path / "out" / MANIFEST_FILE, "a") as fh:
        fh.write('{"shard": "shard-000007-feedface.safetensors", "sample_ids": ["row-5"')
    second = FakeServer()
    summary = run(tmp_path / "prep", tmp_path / "out", "http://a", second.transport())
    assert sorted(requested_ids(second)) == sorted(r.sample_id for r in rows[5:])
    assert summary.n_skipped == 5 and summary.n_samples == N_SAMPLES - 5
    assert_features_equal(tmp_path / "out", rows)
    recorded = {r.shard for r in iter_manifest(tmp_path / "out")}
    assert {p.name for p in shards.iterdir()} == recorded
    third = FakeServer()
    assert run(tmp_path / "prep", tmp_path / "out", "http://a", third.transport()).n_samples == 0
    assert third.requests == []


def test_failover_when_one_server_refuses_connections(tmp_path):
    rows = make_prepared(tmp_path / "prep")
    good = FakeServer()
    dead_calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            dead_calls.append(request.url.path)
            raise httpx.ConnectError("connection refused", request=request)
        return good.handle(request)

    summary = run(
        tmp_path / "prep", tmp_path / "out", ["http://dead:1", "http://alive:2"], httpx.MockTransport(handle),
        request_tokens=30,
    )  # fmt: skip
    assert summary.n_samples == N_SAMPLES and dead_calls
    assert sorted(requested_ids(good)) == sorted(r.sample_id for r in rows)  # each exactly once
    assert_features_equal(tmp_path / "out", rows)


def test_a_batch_whose_server_dies_midway_goes_to_the_other_server(tmp_path):
    rows = make_prepared(tmp_path / "prep")
    a = FakeServer(script=[Call(truncate_after_samples=1)] + [Call(refuse=True)] * 100)
    b = FakeServer()
    servers = {"a": a, "b": b}
    transport = httpx.MockTransport(lambda r: servers[r.url.host].handle(r))
    summary = run(tmp_path / "prep", tmp_path / "out", ["http://a", "http://b"], transport, max_retries=2)
    assert summary.n_samples == N_SAMPLES
    assert_features_equal(tmp_path / "out", rows)
    reader = FeaturesReader(tmp_path / "out")
    assert len(reader.sample_ids) == len(set(reader.sample_ids)) == N_SAMPLES


def test_all_servers_dead_is_a_clear_error_after_retries(tmp_path):
    make_prepared(tmp_path / "prep")
    good = FakeServer()
    calls = {"n": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/info" and calls["n"] == 0:
            calls["n"] += 1
            return good.handle(request)  # alive for the probe, dead afterwards
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(NoServerAvailableError, match=r"every server failed 3 times in a row .*http://x:1"):
        run(tmp_path / "prep", tmp_path / "out", ["http://x:1", "http://y:2"], httpx.MockTransport(handle),
            max_retries=2)  # fmt: skip
    assert list(iter_manifest(tmp_path / "out")) == []


def test_tokenizer_or_vocab_mismatch_fails_before_any_work(tmp_path):
    make_prepared(tmp_path / "prep", tokenizer="ff" * 32)
    server = FakeServer()
    with pytest.raises(IncompatibleError, match="tokenized with tokenizer ffffffffffff"):
        run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport())
    make_prepared(tmp_path / "prep2", vocab=1000)
    with pytest.raises(IncompatibleError, match="vocab_size 1000"):
        run(tmp_path / "prep2", tmp_path / "out", "http://a", server.transport())
    assert server.requests == [] and not (tmp_path / "out").exists()


def test_a_sample_over_the_server_limit_fails_before_any_work(tmp_path):
    make_prepared(tmp_path / "prep", n=3, lengths=[5, 5000, 5])
    server = FakeServer()
    with pytest.raises(IncompatibleError, match=r"'row-1' \(in.jsonl:2\) has 5000 tokens, over .* 4096"):
        run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport())
    assert server.requests == []


def test_free_disk_precheck_fails_early(tmp_path, monkeypatch):
    make_prepared(tmp_path / "prep")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    server = FakeServer()
    with pytest.raises(InsufficientDiskError, match=r"tokens need about .* GB .* only 0\.00 GB free"):
        run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport())
    assert server.requests == []


def test_full_disk_midway_keeps_a_valid_manifest_and_resumes(tmp_path, monkeypatch):
    rows = make_prepared(tmp_path / "prep")
    import builtins

    real_open = builtins.open
    opened = {"tmp": 0}

    def full_open(path, mode="r", *args, **kwargs):  # the third shard file hits a full disk
        if str(path).endswith(".tmp") and Path(path).parent.name == SHARDS_DIR and "w" in mode:
            opened["tmp"] += 1
            if opened["tmp"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_open)
    server = FakeServer()
    with pytest.raises(FeaturesWriteError, match="disk full"):
        run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport(), request_tokens=40, shard_mb=0.004)
    monkeypatch.setattr(builtins, "open", real_open)
    assert len(FeaturesReader(tmp_path / "out", verify=True).records) == 2  # recorded shards are intact
    run(tmp_path / "prep", tmp_path / "out", "http://a", FakeServer().transport())
    assert_features_equal(tmp_path / "out", rows)


def test_failed_samples_are_reported_and_retried_by_a_rerun(tmp_path):
    rows = make_prepared(tmp_path / "prep")
    server = FakeServer(script=[Call(fail_ids=("row-3",))])
    summary = run(tmp_path / "prep", tmp_path / "out", "http://a", server.transport())
    assert summary.n_failed == 1 and summary.failures[0].sample_id == "row-3"
    assert "row-3" not in FeaturesReader(tmp_path / "out")
    again = FakeServer()
    run(tmp_path / "prep", tmp_path / "out", "http://a", again.transport())
    assert requested_ids(again) == ["row-3"]
    assert_features_equal(tmp_path / "out", rows)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert (
        main(["extract", str(tmp_path / "nope"), "--server", "http://127.0.0.1:1", "--out", str(tmp_path / "o")]) == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eagle3 extract: error:") and "meta.json" in err[0]
    make_prepared(tmp_path / "prep")
    argv = ["extract", str(tmp_path / "prep"), "--server", "http://127.0.0.1:1", "--out", str(tmp_path / "o"),
            "--max-retries", "0", "--no-progress"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("eagle3 extract: error: http://127.0.0.1:1: connection failed")
