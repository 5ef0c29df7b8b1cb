"""Property-based fuzz of every route (hypothesis, fixed seed, 400 cases): generated methods, paths,
auth and content-type headers, and bodies (well-formed extract requests with hostile values, mutated
ones, raw bytes). Holds: no 5xx; every 4xx carries the documented envelope with a type of the error
table (core/protocol/error_types.py) whose status and ``x-should-retry`` match; a 200 extract stream
decodes to its terminal frame; and afterwards a known request is still served bitwise equal to before.

The app runs in process (fake engine, SmolLM2's real tokenizer and chat template for ``messages``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from eagle3.core.protocol.error_types import ERROR_TYPES
from eagle3.core.protocol.frames import FrameDecoder, FrameType
from eagle3.server.app import create_app
from tests.unit.test_chat_limits import ChatBackend
from tests.unit.test_server_app import settings as server_settings
from tests.unit.test_server_app import wait_for

KEY = "fuzz-key"
KNOWN = {"samples": [{"id": "known", "input_ids": [5, 6, 7, 8]}, {"id": "chat", "messages": [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]}  # fmt: skip
N_CASES = 400

ints = st.one_of(st.integers(-5, 60000), st.sampled_from([2**31, 2**63, -(2**63), 49151, 49152]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=20))
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
sample_ids = st.one_of(st.text(max_size=30), st.text(min_size=1020, max_size=1100), junk)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool", ""]) | junk,
            "content": st.text(max_size=40) | junk,
        }
    ),
    max_size=6,
)
sample = st.fixed_dictionaries(
    {"id": sample_ids},
    optional={
        "input_ids": st.lists(ints, max_size=40) | junk,
        "loss_mask": st.lists(st.integers(-1, 2), max_size=40) | junk,
        "messages": messages | junk,
        "extra": junk,
    },
)
extract_bodies = st.fixed_dictionaries(
    {"samples": st.lists(sample, max_size=5) | junk},
    optional={"codec": st.sampled_from(["zstd+planes", "zstd", "none", "gzip", ""]) | junk, "zstd_level": ints | junk},
)
bodies = st.one_of(
    *[extract_bodies.map(lambda b: json.dumps(b).encode())] * 4,
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
)
paths = st.sampled_from(["/v1/extract", "/v1/info", "/metrics", "/", "/livez", "/readyz", "/v1/extract/", "/v2/x",
                         "/v1/info?api_key=x", "/%00", "/v1/../v1/info"])  # fmt: skip
methods = st.sampled_from(["POST", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
routes = st.integers(0, 3).flatmap(  # three in four cases are extract calls: that is where the input goes
    lambda k: st.tuples(methods, paths) if k == 3 else st.just(("POST", "/v1/extract"))
)
auths = st.sampled_from([*[f"Bearer {KEY}"] * 6, "Bearer nope", f"Basic {KEY}", "", f"bearer {KEY} x"])
ctypes = st.sampled_from([*["application/json"] * 6, "text/plain", "", "application/json; charset=latin-1"])
tenants = st.sampled_from([None, "t", "bad tenant!", "x" * 80])


@pytest.fixture(scope="module")
def client(smollm2_dir: Path) -> Iterator[TestClient]:
    app = create_app(server_settings(api_keys={KEY: "fuzzer"}, max_request_tokens=4096), ChatBackend(smollm2_dir))
    with TestClient(app, raise_server_exceptions=False) as c:
        wait_for(c, "ready")
        yield c


def known_answer(client: TestClient) -> list[tuple[str, Any, bytes]]:
    resp = client.post("/v1/extract", json=KNOWN, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200
    decoder = FrameDecoder()
    frames = decoder.feed(resp.content)
    decoder.close()
    return sorted((f.type.name, f.meta.get("sample_id"), bytes(f.payload)) for f in frames if f.type == FrameType.DATA)


def check_answer(method: str, path: str, resp: Any) -> None:
    assert resp.status_code < 500, (method, path, resp.status_code, resp.text[:300])
    if resp.status_code >= 400 and method == "HEAD":  # HTTP: a HEAD answer has no body
        assert resp.content == b"" and resp.headers["x-request-id"]
    elif resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"type", "message", "code", "param", "reason"}, error
        known = ERROR_TYPES[error["type"]]
        assert known.status == resp.status_code == error["code"] and error["message"], error
        assert resp.headers["x-should-retry"] == ("true" if known.retryable else "false")
        assert resp.headers["x-request-id"]
    elif path == "/v1/extract" and method == "POST":
        decoder = FrameDecoder()
        frames = decoder.feed(resp.content)
        decoder.close()
        assert frames[-1].type == FrameType.END, frames[-1]  # never an ERROR (internal) frame


def test_no_route_answers_5xx_or_outside_the_envelope(client: TestClient) -> None:
    before = known_answer(client)
    seen: dict[int, int] = {}

    @seed(20261204)
    @settings(max_examples=N_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(route=routes, auth=auths, ctype=ctypes, tenant=tenants, body=bodies)
    def case(route: tuple[str, str], auth: str, ctype: str, tenant: str | None, body: bytes) -> None:
        method, path = route
        headers = {"Authorization": auth, "Content-Type": ctype}
        if tenant is not None:
            headers["X-Eagle3-Tenant"] = tenant
        resp = client.request(method, path, content=body if method not in ("GET", "HEAD") else None, headers=headers)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        check_answer(method, path, resp)

    case()
    assert known_answer(client) == before  # the server still serves, bitwise the same
    assert {200, 400, 401, 404, 405, 415} <= set(seen), seen  # the fuzz reached every layer
    print(f"route fuzz: {sum(seen.values())} cases, status counts {dict(sorted(seen.items()))}")
