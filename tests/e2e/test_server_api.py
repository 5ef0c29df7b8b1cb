"""A live ``eagle3 serve`` (tiny random Llama with SmolLM2's tokenizer): auth, every bad-input class,
413, streaming layout and chunking, fairness between tenants, and a client killed mid-stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from eagle3.core.protocol.frames import CONTENT_TYPE, FrameType
from tests.e2e.live_server import LiveServer, assemble, iter_frames, tiny_llama_dir

pytestmark = pytest.mark.e2e
KEYS = {"tenant-a": "key-aaaa", "tenant-b": "key-bbbb"}
MAX_MODEL_LEN = 511  # the tiny model has 512 positions; vLLM keeps one for the token generate() makes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("api")
    model = tiny_llama_dir(root / "tiny", tokenizer_from=smollm2_dir)
    args = ["--model", str(model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-batch-tokens", "128", "--max-request-tokens", "40000",
            "--max-tenant-inflight-tokens", "60000", "--max-body-mb", "1", "--max-payload-mb", "0.1",
            "--heartbeat-s", "0.5"]  # fmt: skip
    with LiveServer(args, root / "server.log", api_keys=KEYS) as live:
        live.wait_ready()
        yield live


def extract(server: LiveServer, body: Any, tenant: str = "tenant-a", **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**server.headers(tenant), "Content-Type": "application/json"}
    return httpx.post(f"{server.url}/v1/extract", content=content, headers=headers, timeout=60, **kwargs)


def ids_samples(n: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"id": f"s{i}", "input_ids": rng.integers(0, 49152, length).tolist()} for i in range(n)]


def assert_envelope(resp: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"type", "message", "code", "param", "reason"}
    assert (err["type"], err["code"]) == (type_, status)
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert resp.headers["x-request-id"]
    assert resp.headers["x-should-retry"] == ("true" if status in (408, 429, 503) or status >= 500 else "false")
    return dict(err)


def test_probes_are_open_and_everything_else_needs_a_key(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/livez").json() == {"status": "alive"}
    assert httpx.get(f"{server.url}/readyz").json() == {"status": "ready"}
    for method, path in [("GET", "/"), ("GET", "/metrics"), ("GET", "/v1/info"), ("GET", "/openapi.json"),
                         ("POST", "/v1/extract")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS['tenant-a']}"}):
            resp = httpx.request(method, f"{server.url}{path}", headers=headers, content=b"{}")
            assert_envelope(resp, 401, "unauthorized")
            assert resp.headers["www-authenticate"] == "Bearer"
        assert httpx.request("GET", f"{server.url}{path}", headers=server.headers()).status_code in (200, 405)
    info = httpx.get(f"{server.url}/v1/info", headers=server.headers("tenant-b")).json()
    assert info["aux_layer_ids"] == [2, 4, 5] and info["final_layer_id"] == 8 and info["final_norm_applied"] is False
    assert info["limits"]["max_request_tokens"] == 40000 and info["max_model_len"] == MAX_MODEL_LEN
    sent = httpx.get(f"{server.url}/v1/info", headers={**server.headers(), "X-Request-Id": "abc-123"})
    assert sent.headers["x-request-id"] == "abc-123"
    assert KEYS["tenant-a"] not in server.log() and KEYS["tenant-b"] not in server.log()


BAD_INPUTS: list[tuple[str, Any, str | None]] = [
    ("not json", b"{samples: oops", None),
    ("samples missing", {"codec": "zstd"}, "samples"),
    ("samples empty", {"samples": []}, "samples"),
    ("unknown field", {"samples": [{"id": "a", "input_ids": [1]}], "bogus": 1}, "bogus"),
    ("ids not ints", {"samples": [{"id": "a", "input_ids": ["1", 2]}]}, "samples[0].input_ids[0]"),
    ("float ids", {"samples": [{"id": "a", "input_ids": [1.5]}]}, "samples[0].input_ids[0]"),
    ("empty sample", {"samples": [{"id": "a", "input_ids": []}]}, "samples[0].input_ids"),
    ("empty id", {"samples": [{"id": "", "input_ids": [1]}]}, "samples[0].id"),
    ("negative id", {"samples": [{"id": "a", "input_ids": [1, -1]}]}, "samples[0].input_ids[1]"),
    ("id >= vocab", {"samples": [{"id": "a", "input_ids": [49152]}]}, "samples[0].input_ids[0]"),
    ("over max_model_len", {"samples": [{"id": "a", "input_ids": [1] * (MAX_MODEL_LEN + 1)}]}, "samples[0].input_ids"),
    ("duplicate ids", {"samples": [{"id": "a", "input_ids": [1]}, {"id": "a", "input_ids": [2]}]}, "samples[1].id"),
    ("over max_request_tokens", {"samples": ids_samples(100, 401)}, "samples"),
    ("mask length", {"samples": [{"id": "a", "input_ids": [1, 2], "loss_mask": [1]}]}, "samples[0].loss_mask"),
    ("mask values", {"samples": [{"id": "a", "input_ids": [1, 2], "loss_mask": [1, 2]}]}, "samples[0].loss_mask"),
    ("ids and messages", {"samples": [{"id": "a", "input_ids": [1], "messages": []}]}, "samples[0]"),
    ("neither", {"samples": [{"id": "a"}]}, "samples[0]"),
    ("bad codec", {"samples": [{"id": "a", "input_ids": [1]}], "codec": "gzip"}, "codec"),
    ("bad level", {"samples": [{"id": "a", "input_ids": [1]}], "zstd_level": 99}, "zstd_level"),
    ("assistant first", {"samples": [{"id": "a", "messages": [{"role": "assistant", "content": "x"}]}]},
     "samples[0].messages"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "param"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_400_and_the_server_keeps_serving(server: LiveServer, case: str, body: Any, param: Any) -> None:
    assert_envelope(extract(server, body), 400, "invalid_request", param)
    ok = extract(server, {"samples": [{"id": "x", "input_ids": [5, 6, 7]}]})
    assert ok.status_code == 200 and [f.type for f in iter_frames(ok)][-1] == FrameType.END


def test_oversize_body_is_a_413_with_or_without_content_length(server: LiveServer) -> None:
    big = json.dumps({"samples": ids_samples(1, 200_000)}).encode()  # ~1.2 MB > 1 MiB
    assert_envelope(extract(server, big), 413, "payload_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    headers = {**server.headers(), "Content-Type": "application/json"}
    resp = httpx.post(f"{server.url}/v1/extract", content=chunks(), headers=headers, timeout=60)
    assert_envelope(resp, 413, "payload_too_large")
    assert server.metrics()['eagle3_rejections_total{reason="payload_too_large"}'] >= 2


def test_unknown_route_and_method_get_the_envelope(server: LiveServer) -> None:
    assert_envelope(httpx.get(f"{server.url}/v2/nothing", headers=server.headers()), 404, "not_found")
    assert_envelope(httpx.get(f"{server.url}/v1/extract", headers=server.headers()), 405, "method_not_allowed")


@pytest.mark.parametrize("codec", ["zstd+planes", "zstd+shuffle", "zstd", "none"])
def test_stream_layout_chunking_and_messages(server: LiveServer, codec: str) -> None:
    long_ids = ids_samples(1, 400, seed=3)[0]["input_ids"]  # 400 tok * 4 * 64 * 2 B = 205 KB raw
    body = {"codec": codec, "samples": [
        {"id": "long", "input_ids": long_ids, "loss_mask": [1, 0] * 200},
        {"id": "chat", "messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]},
    ]}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/extract", json=body, headers=server.headers(), timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == CONTENT_TYPE
        frames = list(iter_frames(resp))
    assert frames[0].type == FrameType.HEADER and frames[-1].type == FrameType.END
    header, end = frames[0].meta, frames[-1].meta
    assert header["n_samples"] == 2 and header["dtype"] == "bfloat16" and header["hidden_size"] == 64
    long_frames = [f for f in frames if f.type == FrameType.DATA and f.meta["sample_id"] == "long"]
    assert len(long_frames) >= 2, "a sample over max_payload_bytes must be split"
    assert [f.meta["final"] for f in long_frames] == [False] * (len(long_frames) - 1) + [True]
    assert all(f.meta["raw_bytes"] <= 0.1 * 2**20 for f in long_frames)
    samples = assemble(frames)
    assert samples["long"]["hidden_states"].shape == (400, 4, 64)
    assert samples["long"]["input_ids"].tolist() == long_ids
    assert samples["long"]["loss_mask"].tolist() == [1, 0] * 200
    assert samples["chat"]["loss_mask"].sum() > 0 and samples["chat"]["loss_mask"][0] == 0
    assert end["n_samples"] == 2 and end["n_failed"] == 0 and end["n_frames"] == len(frames)
    assert end["n_tokens"] == 400 + len(samples["chat"]["input_ids"])


def read_events(server: LiveServer, tenant: str, body: dict[str, Any], log: list[tuple[str, str]], lock: Any) -> None:
    with httpx.stream("POST", f"{server.url}/v1/extract", json=body, headers=server.headers(tenant), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for frame in iter_frames(r):
            if frame.type in (FrameType.DATA, FrameType.END):
                with lock:
                    log.append((tenant, frame.type.name))


def test_small_tenant_finishes_while_a_large_one_streams(server: LiveServer) -> None:
    log: list[tuple[str, str]] = []
    lock = threading.Lock()
    big = {"samples": ids_samples(200, 64, seed=1)}  # 12.8k tokens in 128-token batches
    small = {"samples": ids_samples(10, 64, seed=2)}
    a = threading.Thread(target=read_events, args=(server, "tenant-a", big, log, lock))
    a.start()
    while True:  # B starts once A is streaming
        with lock:
            if sum(1 for t, _ in log if t == "tenant-a") >= 5:
                break
        time.sleep(0.01)
    read_events(server, "tenant-b", small, log, lock)
    with lock:
        a_done_before_b = sum(1 for t, kind in log if t == "tenant-a" and kind == "DATA")
    a.join()
    assert ("tenant-a", "END") in log
    assert log.index(("tenant-b", "END")) < log.index(("tenant-a", "END"))
    assert a_done_before_b < 100, f"B finished only after {a_done_before_b} of A's 200 samples"


KILLED_CLIENT = textwrap.dedent("""
    import json, sys, httpx
    url, key = sys.argv[1], sys.argv[2]
    body = {"samples": [{"id": f"s{i}", "input_ids": [i % 900 + 1] * 200} for i in range(150)]}
    with httpx.stream("POST", url + "/v1/extract", json=body, headers={"Authorization": "Bearer " + key},
                      timeout=60) as r:
        for n, _ in enumerate(r.iter_raw()):
            if n == 1:
                print("reading", flush=True)
            if n >= 1:
                import time; time.sleep(3600)
""")


def test_killed_client_returns_its_budget(server: LiveServer) -> None:
    before = server.metrics().get("eagle3_cancellations_total", 0)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.url, KEYS["tenant-b"]],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
    m = server.metrics()
    assert m['eagle3_tenant_inflight_tokens{tenant="tenant-b"}'] > 0 and m["eagle3_active_requests"] == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["eagle3_active_requests"] == 0:
            break
        time.sleep(0.1)
    assert m["eagle3_inflight_tokens"] == 0 and m["eagle3_active_requests"] == 0
    assert not [k for k in m if k.startswith("eagle3_tenant_inflight_tokens")]
    assert not [k for k, v in m.items() if k.startswith("eagle3_queue_samples") and v]
    assert m["eagle3_cancellations_total"] == before + 1
    ok = extract(server, {"samples": ids_samples(2, 10)}, tenant="tenant-b")
    assert ok.status_code == 200 and [f.type for f in iter_frames(ok)][-1] == FrameType.END
