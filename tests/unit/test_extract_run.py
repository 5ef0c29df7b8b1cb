"""The extraction run's seams (client/extract.py ``_ExtractRun``, client/fetch.py ``SampleFetcher``).

``extract_dataset`` reads each server's ``/v1/info`` once (it read it 5 times before the first sample
with one server and two request threads), cuts the requests once (each request the SDK sends is a
batch the run cut, never split again), and ``SampleFetcher`` works on its own, without a features
directory: given servers and samples it yields every sample decoded, across a failing server, which is
what a trainer streaming its micro-batches needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import numpy as np

from eagle3.client.extract import ExtractConfig, extract_dataset
from eagle3.client.extract_work import cut_batches
from eagle3.client.fetch import FetchSettings, SampleFetcher
from eagle3.core.protocol.wire import ServerInfo
from eagle3.core.sample import ExtractedSample
from tests.unit.sdk_fake import Call, FakeServer, expected_hidden
from tests.unit.test_sdk_extract import make_prepared


class CountingServers:
    """FakeServers by host, counting each host's /v1/info reads and /v1/extract bodies."""

    def __init__(self, **servers: FakeServer) -> None:
        self.servers = servers
        self.info_reads = dict.fromkeys(servers, 0)
        self.reads_before_first_extract: int | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/info":
            self.info_reads[host] += 1
        elif request.url.path == "/v1/extract" and self.reads_before_first_extract is None:
            self.reads_before_first_extract = sum(self.info_reads.values())
        return self.servers[host].handle(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def test_v1_info_is_read_once_per_server_and_requests_are_cut_once(tmp_path: Path) -> None:
    rows = make_prepared(tmp_path / "prep", n=40)
    servers = CountingServers(a=FakeServer(), b=FakeServer())
    config = ExtractConfig(progress=False, requests_per_server=3, request_tokens=60)
    urls = ["http://a", "http://b"]
    summary = extract_dataset(
        tmp_path / "prep", tmp_path / "out", urls, config=config, transport=servers.transport(), sleep=lambda s: None
    )
    assert summary.n_samples == len(rows)
    # a's info before its first request; b's may come first or not (its worker thread's timing): never more
    assert servers.reads_before_first_extract in (1, 2)
    # each server's /v1/info at most once, whatever its request threads (b's workers may find every batch
    # taken by a's before they start: then b is never asked at all)
    assert servers.info_reads["a"] == 1 and servers.info_reads["b"] <= 1, servers.info_reads
    bodies = [body for server in servers.servers.values() for body in server.requests]
    lengths = {r.sample_id: r.n_tokens for r in rows}
    sent = [[s["id"] for s in body["samples"]] for body in bodies]
    assert sorted(i for ids in sent for i in ids) == sorted(lengths)
    assert all(sum(lengths[i] for i in ids) <= 60 or len(ids) == 1 for ids in sent)
    # cut once: the requests are exactly the run's batches (consecutive runs of the prepared order, each as
    # full as 60 tokens allow), none split again by the SDK
    want = [[s.sample_id for s in batch] for batch in cut_batches(iter(rows), 60, 1 << 40)]
    assert sorted(sent) == sorted(want)


def test_the_fetcher_alone_yields_every_sample_decoded_across_a_failing_server(tmp_path: Path) -> None:
    rows = make_prepared(tmp_path / "prep", n=15)
    flaky = FakeServer(script=[Call(refuse=True)] * 1000)  # down for good: given up, its batches go to b
    servers = CountingServers(a=flaky, b=FakeServer())
    info = dataclasses.replace(ServerInfo.from_dict(flaky.info), url="http://a")
    settings = FetchSettings(request_tokens=50, requests_per_server=1, buffer_bytes=1 << 16, max_retries=3)
    got: dict[str, ExtractedSample] = {}
    urls, transport = ["http://a", "http://b"], servers.transport()
    fetcher = SampleFetcher(
        urls, None, info.identity, iter(rows), settings, known=[info], transport=transport, sleep=lambda s: None
    )
    with fetcher:
        for item in fetcher:
            assert isinstance(item, ExtractedSample), item
            assert item.sample_id not in got
            got[item.sample_id] = item
            fetcher.release(item)
    assert sorted(got) == sorted(r.sample_id for r in rows)
    for row in rows:
        np.testing.assert_array_equal(got[row.sample_id].hidden_states_bf16, expected_hidden(row.input_ids))
        assert got[row.sample_id].input_ids.tolist() == row.input_ids
    assert servers.info_reads == {"a": 0, "b": 1}, "a known server's /v1/info is not read again"
    assert fetcher.wire_bytes > 0 and all(not w.is_alive() for w in fetcher.workers)
