"""The status page of a live ``eagle3 serve --public-status``, rendered by a real headless Chromium
(Debian's ``chromium``): every figure the browser shows equals the same series in a ``/metrics``
scrape taken right before it, tenant names with markup and quotes are shown as text, and the
screenshot is a real page (not blank). Skipped without chromium unless EAGLE3_REQUIRE_CHROMIUM=1
(``.ci/run`` sets it and installs chromium)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.live_server import LiveServer, iter_frames, tiny_llama_dir

pytestmark = pytest.mark.e2e
KEYS = {"alice": "key-alice", 'bob "the" <b>builder</b>': "key-bob"}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        if os.environ.get("EAGLE3_REQUIRE_CHROMIUM") == "1":
            pytest.fail("EAGLE3_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install -y chromium)")
        pytest.skip("no chromium on PATH (apt-get install -y chromium)")
    return found


def browse(binary: str, url: str, *extra: str) -> str:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--window-size=1280,1000", "--virtual-time-budget=3000", *extra, url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class MetricCells(HTMLParser):
    """``data-metric`` -> the cell's text, and every table cell's text, from the DOM Chromium built."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, str] = {}
        self.texts: list[str] = []
        self._metric: str | None = None
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "td":
            self._in_cell = True
            self.texts.append("")
            self._metric = dict(attrs).get("data-metric")
            if self._metric is not None:
                self.cells[self._metric] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_cell, self._metric = False, None

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.texts[-1] += data
            if self._metric is not None:
                self.cells[self._metric] += data


def scrape(server: LiveServer) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers("alice"), timeout=10).text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value_of(series: str, scraped: list[tuple[str, dict[str, str], float]]) -> float:
    """A page cell's ``data-metric`` (``name{labels}``, parsed by prometheus_client's own parser) summed
    over the scraped samples whose labels include those (0 when the series is absent, as for a gauge
    of a tenant with nothing in flight)."""
    (family,) = text_string_to_metric_families(f"{series} 0\n")
    (want,) = family.samples
    return sum(v for name, labels, v in scraped if name == want.name and want.labels.items() <= labels.items())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("status")
    model = tiny_llama_dir(root / "tiny", tokenizer_from=smollm2_dir)
    args = ["--model", str(model), "--dtype", "float32", "--public-status", "--admin-tenant", "alice",
            "--max-body-mb", "1", "--max-batch-tokens", "256"]  # fmt: skip
    with LiveServer(args, root / "server.log", api_keys=KEYS) as live:
        live.wait_ready()
        yield live


def test_the_page_chromium_renders_shows_what_metrics_says(server: LiveServer, tmp_path: Path) -> None:
    binary = chromium()
    rng = np.random.default_rng(0)
    for tenant, n in (("alice", 3), ('bob "the" <b>builder</b>', 2)):
        samples = [{"id": f"s{i}", "input_ids": rng.integers(0, 49152, 40 + i).tolist()} for i in range(n)]
        resp = httpx.post(f"{server.url}/v1/extract", json={"samples": samples}, headers=server.headers(tenant),
                          timeout=60)  # fmt: skip
        assert [f.type.name for f in iter_frames(resp)][-1] == "END"
    too_big = b'{"samples": [' + b" " * (2 << 20) + b"]}"
    json_headers = {**server.headers("alice"), "Content-Type": "application/json"}
    assert httpx.post(f"{server.url}/v1/extract", content=too_big, headers=json_headers).status_code == 413
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # metrics still need a key; the page does not

    metrics = scrape(server)
    dom = browse(binary, server.url + "/", "--dump-dom")
    page = MetricCells()
    page.feed(dom)

    assert page.cells, dom[:2000]
    for series, shown in page.cells.items():
        assert int(shown.replace(",", "")) == value_of(series, metrics), (series, shown)
    assert int(page.cells["eagle3_tokens_extracted_total"].replace(",", "")) == 3 * 40 + 3 + 2 * 40 + 1
    assert int(page.cells['eagle3_requests_total{tenant="alice"}']) == 1
    assert int(page.cells['eagle3_rejections_total{tenant="alice"}']) == 1
    assert 'bob "the" <b>builder</b>' in page.texts, "the tenant name must be shown as text, not markup"
    assert "<b>builder</b>" not in dom.replace("&lt;b&gt;", "")  # never parsed as a tag
    assert "payload_too_large" in page.texts
    info = httpx.get(f"{server.url}/v1/info", headers=server.headers("alice"), timeout=10).json()
    assert f"<td>{info['model_id']}</td>" in dom and "key-alice" not in dom and "key-bob" not in dom

    shot = tmp_path / "status.png"
    browse(binary, server.url + "/", f"--screenshot={shot}")
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1280, 1000)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 20, "the screenshot is blank"
