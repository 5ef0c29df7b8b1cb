"""The feature cache through live ``eagle3 serve`` processes and the SDK (hf backend, a tiny random Llama
in float32: a real transformers forward whose states do not depend on batching).

One story, in order: a first extraction fills the cache (misses); two tenants then ask for the same
samples and new ones at the same time (each distinct sample computed once, both get the same bytes);
a ``cache="bypass"`` client makes the backend compute again (same bytes); after a restart on the same
``--feature-cache-dir`` a new process serves everything from disk except one entry whose byte was flipped
(a miss, recomputed, the right answer); and a server without any cache returns the same bytes.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np

from eagle3.client.sdk import ExtractionClient
from tests.e2e.live_server import LiveServer, tiny_llama_dir

KEYS = {"alice": "key-alice", "bob": "key-bob"}


def server(tmp_path: Path, model: Path, name: str, *extra: str) -> LiveServer:
    args = ["--backend", "hf", "--model", str(model), "--dtype", "float32", "--max-batch-tokens", "512", *extra]
    live = LiveServer(args, tmp_path / f"{name}.log", api_keys=KEYS)
    live.wait_ready(timeout_s=300)
    return live


def extract(live: LiveServer, samples: list[list[int]], tenant: str = "alice", **kw: str) -> dict[str, np.ndarray]:
    with ExtractionClient(live.url, KEYS[tenant], **kw) as client:  # type: ignore[arg-type]
        reqs = [{"id": f"s{i}", "input_ids": ids} for i, ids in enumerate(samples)]
        return {s.sample_id: np.array(s.hidden_states_bf16) for s in client.extract(reqs)}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_cache_repeat_concurrency_bypass_restart_corruption_and_no_cache_agree(tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path / "model")
    cache_dir = tmp_path / "cache"
    rng = random.Random(0)
    first = [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    more = [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(8)]

    with server(tmp_path, model, "one", "--feature-cache-dir", str(cache_dir)) as live:
        info = ExtractionClient(live.url, KEYS["alice"]).info()
        assert info.cache_on and info.feature_cache["disk_bytes"] > 0
        cold = extract(live, first)
        m = live.metrics()
        assert m["eagle3_cache_misses_total"] == 12 and m["eagle3_cache_hits_total"] == 0
        passes = m["eagle3_forward_passes_total"]

        assert same(extract(live, first), cold), "a repeat must return the bytes of the first run"
        m = live.metrics()
        assert m['eagle3_cache_hits_total{tier="memory"}'] == 12
        assert m["eagle3_forward_passes_total"] == passes, "a repeat ran the verifier"

        both = first + more  # two tenants, the same keys, at the same time
        got: dict[str, dict[str, np.ndarray]] = {}
        threads = [threading.Thread(target=lambda t=t: got.update({t: extract(live, both, t)})) for t in KEYS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert same(got["alice"], got["bob"])
        assert all(np.array_equal(got["alice"][f"s{i}"], cold[f"s{i}"]) for i in range(12))
        m = live.metrics()
        assert m["eagle3_cache_misses_total"] == 12 + 8, "each new sample is computed once for both tenants"
        assert m["eagle3_tokens_extracted_total"] == sum(len(s) for s in both)

        bypass = extract(live, first, cache="bypass")
        m2 = live.metrics()
        assert same(bypass, cold) and m2["eagle3_forward_passes_total"] > m["eagle3_forward_passes_total"]
        assert m2["eagle3_cache_misses_total"] == m["eagle3_cache_misses_total"], "bypass must not look up"
        assert m2['eagle3_cache_bytes{tier="disk"}'] > 0 and m2['eagle3_cache_entries{tier="disk"}'] == 20
    # SIGTERM: the server drained and flushed its disk writes on the way out

    files = sorted(cache_dir.rglob("*.e3c"))
    assert len(files) == 20
    data = bytearray(files[0].read_bytes())
    data[-40] ^= 0x10  # a byte of the stored states or ids
    files[0].write_bytes(bytes(data))

    with server(tmp_path, model, "two", "--feature-cache-dir", str(cache_dir)) as live:
        again = extract(live, both)
        m = live.metrics()
        assert m['eagle3_cache_hits_total{tier="disk"}'] == 19 and m["eagle3_cache_misses_total"] == 1
        assert m["eagle3_cache_corrupt_total"] == 1
        assert same(again, got["alice"]), "the corrupt entry was recomputed to the same answer"

    with server(tmp_path, model, "off", "--cache-memory-mb", "0") as live:
        info = ExtractionClient(live.url, KEYS["alice"]).info()
        assert not info.cache_on
        assert same(extract(live, both), got["alice"]), "results differ with and without the cache"
        assert "eagle3_cache_misses_total" not in live.metrics()
