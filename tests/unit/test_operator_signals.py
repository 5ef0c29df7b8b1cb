"""What an operator reads off a server (issue 30 item 5): /metrics carries the process's own series
(``process_*``, ``python_*``) and an ``eagle3_info`` series (version, backend, model) besides eagle3's;
the status page's refresh is not an INFO line every 5 s; with ``--log-format json`` the dictConfig given
to every vLLM process writes eagle3's JSON lines. The live vllm case (vLLM's own ``vllm:*`` series,
every vLLM log line JSON) is tests/e2e/test_vllm_server.py::test_json_logs_and_engine_metrics_of_the_vllm_backend."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from eagle3.core.json_log import JsonFormatter, root_logs_json
from eagle3.server.app import create_app
from eagle3.server.backends.vllm_phases import HANDLER_NAME, logging_config
from eagle3.server.metrics import package_version
from tests.unit.test_server_app import FakeBackend, settings, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):  # raises on a malformed exposition
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_metrics_carry_process_series_and_an_info_series(tmp_path: Path) -> None:
    with TestClient(create_app(settings(public_metrics=True), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        got = families(client.get("/metrics").text)
    assert got["process_cpu_seconds_total"][0][1] > 0
    assert got["process_resident_memory_bytes"][0][1] > 1 << 20
    assert got["python_info"][0][0]["implementation"] == "CPython"
    (labels, value), *more = got["eagle3_info"]
    assert not more and value == 1
    assert labels == {"version": package_version(), "backend": "fake", "model": "fake"}
    assert "eagle3_requests_total" in got or "eagle3_forward_passes_total" in got  # eagle3's own still there


def test_the_status_page_refresh_is_not_an_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with TestClient(create_app(settings(), FakeBackend(tmp_path))) as client:
        wait_for(client, "ready")
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="eagle3.server.requests"):
            for _ in range(3):
                assert client.get("/").status_code == 200  # the page reloads itself every 5 s
                assert client.get("/v1/status").status_code == 200
            client.get("/v1/info")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "eagle3.server.requests"]
    page = [(lvl, m) for lvl, m in lines if m.startswith(("GET / ", "GET /v1/status "))]
    assert len(page) == 6 and {lvl for lvl, _ in page} == {logging.DEBUG}, page  # still there at debug
    assert any(m.startswith("GET /v1/info 200") for lvl, m in lines if lvl == logging.INFO)


VLLM_LIKE_DEFAULT = {  # the shape of vllm.logger.DEFAULT_LOGGING_CONFIG (a text console handler)
    "formatters": {"vllm": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
    "handlers": {
        "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO", "stream": "ext://sys.stdout"}
    },
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    "version": 1,
    "disable_existing_loggers": False,
}

CHILD = """
import json, logging.config, multiprocessing, sys
def child(config):
    logging.config.dictConfig(config)
    logging.getLogger("vllm.v1.engine.core").info("Loading weights took %.2f seconds", 1.5)
if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    logging.config.dictConfig(config)
    logging.getLogger("vllm.entrypoints.llm").warning("from the server process")
    process = multiprocessing.get_context("spawn").Process(target=child, args=(config,), name="EngineCore_DP0")
    process.start(); process.join()
"""


def test_vllm_processes_write_json_lines_when_the_server_does(tmp_path: Path) -> None:
    """The dictConfig handed to vLLM (LoggingConfig.pylogging_config_file, applied in the server and in
    every engine/worker process it spawns): JSON lines with --log-format json, vLLM's text otherwise."""
    phase_log = tmp_path / "phases.log"
    phase_log.touch()
    config = logging_config(VLLM_LIKE_DEFAULT, str(phase_log), "INFO", json_lines=True)
    assert HANDLER_NAME in config["loggers"]["vllm"]["handlers"]  # the phase file still gets its records
    script = tmp_path / "vllm_like.py"  # a file: spawn re-imports the main module to find ``child``
    script.write_text(CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO_ROOT)},
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # every line parses
    assert [(x["level"], x["logger"], x["message"]) for x in lines] == [
        ("warning", "vllm.entrypoints.llm", "from the server process"),
        ("info", "vllm.v1.engine.core", "Loading weights took 1.50 seconds"),
    ]
    assert "process" not in lines[0] and lines[1]["process"] == "EngineCore_DP0"
    assert "Loading weights took" in phase_log.read_text()  # the /readyz phases are read as before
    text = logging_config(VLLM_LIKE_DEFAULT, str(phase_log), "INFO")
    assert text["handlers"]["vllm"]["formatter"] == "vllm"  # --log-format text: vLLM's lines unchanged


def test_root_logs_json_follows_the_root_handlers() -> None:
    root = logging.getLogger()
    saved = [(h, h.formatter) for h in root.handlers]
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        assert not root_logs_json()
        for h in root.handlers:
            h.setFormatter(JsonFormatter())
        assert root_logs_json()
    finally:
        root.removeHandler(handler)
        for h, formatter in saved:
            h.setFormatter(formatter)
