"""The serving path's own ceiling: ``eagle3 serve --backend synthetic`` -> ``extract_dataset`` -> disk.

    .venv/bin/python bench/extract.py --backend synthetic --hidden-size 4096            # ~2 min here
    .venv/bin/python bench/extract.py --backend synthetic --hidden-size 4096 --tokens 40000

The synthetic backend returns deterministic bf16 states at memory speed, so what is measured is
everything but the verifier: scheduling, copies, framing, codec, HTTP, the client's checks and
decoding, the shard writer. One run, side by side on the same prepared samples (random token ids,
lengths around ``--p50`` tokens, SmolLM2's tokenizer):

* ``bare_stream``: a bare uvicorn ``StreamingResponse`` -> httpx ``iter_raw`` stream of the same number
  of bytes (2 MiB writes of one precomputed buffer), in a subprocess like the server: the HTTP ceiling;
* one ``extract_dataset`` run per codec (``none``, the server default ``auto``, ``zstd+planes``) against
  one server, each into a fresh directory, after one warm-up run of the same samples under other ids
  (codec ``none``, reported as ``warm_up_none_mb_per_s``, not in the ratios: a fresh process's one-off
  costs would otherwise land on the first codec): raw MB/s,
  wire/raw, and seconds per stage: server forward/copy/encode/send (``/metrics`` deltas), client
  receive/verify/decode/write;
* ``none, fresh buffers``: ``none`` again with the client's buffer pool off (``recycle_buffers=False``:
  fresh memory for every frame body, as before the pool), side by side;
* each codec's encode and decode MB/s on one core, and shard hashing MB/s (sha256, xxh3-128);
* ``cpu_s_per_gb``: CPU seconds (user + system, all threads) per GB of raw states in the server process
  and in the client process, for the bare stream and every run. Work, not waiting: the load of this
  shared VM moves it far less than MB/s, and it is what a host with more cores divides.

Bars (issue 12): ``none`` >= 0.6x the bare stream; the default codec >= 0.5x ``none``.
Stage seconds are summed over threads: they overlap and can exceed the wall time.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.client.extract import ExtractConfig, extract_dataset  # noqa: E402
from eagle3.core.codec import decode_payload, encode_payload  # noqa: E402
from eagle3.core.identity import tokenizer_sha256  # noqa: E402
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.core.protocol.frames import CODEC_NAMES  # noqa: E402
from eagle3.core.protocol.prepared import META_FILE, SAMPLES_FILE, PreparedMeta  # noqa: E402
from eagle3.local_server import LocalServer, free_port  # noqa: E402
from eagle3.server.codec_choice import PROBE_BYTES, measure_encode_mb_s  # noqa: E402

BARE_CHUNK_BYTES = 2 << 20


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of process ``pid`` so far; this process when None."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks


def cpu_s_per_gb(server_s: float, client_s: float, n_bytes: int) -> dict[str, float]:
    """CPU seconds per GB (1e9 raw bytes) on each side: a figure the machine's load moves far less than
    MB/s (it counts work, not waiting), and the one that scales to a host with more cores."""
    gb = n_bytes / 1e9
    return {"server": round(server_s / gb, 3), "client": round(client_s / gb, 3),
            "total": round((server_s + client_s) / gb, 3)}  # fmt: skip


def random_prepared(out: Path, n_tokens: int, p50: int, seed: int = 0) -> tuple[Path, int, int]:
    """A prepared directory of random token ids (lengths log-normal around ``p50``, 16..4*p50) for
    SmolLM2's tokenizer: ``(dir, n_samples, n_tokens)``."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(DEFAULT_MODEL)
    vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    meta = PreparedMeta(
        model=DEFAULT_MODEL,
        model_dir=str(model_dir),
        tokenizer_sha256=tokenizer_sha256(model_dir),
        chat_template_sha256="synthetic",
        vocab_size=vocab_size,
        max_length=4 * p50,
        overlong="drop",
        inputs=["synthetic"],
    )
    (out / META_FILE).write_text(meta.to_json())
    rng = random.Random(seed)  # noqa: S311 (reproducible data, not security)
    total, n = 0, 0
    with open(out / SAMPLES_FILE, "w") as fh:
        while total < n_tokens:
            length = max(16, min(4 * p50, int(rng.lognormvariate(0, 0.6) * p50), n_tokens - total))
            ids = [rng.randrange(vocab_size) for _ in range(length)]
            mask = [0] * min(8, length - 1) + [1] * (length - min(8, length - 1))
            fh.write(json.dumps({"id": f"s{n}", "input_ids": ids, "loss_mask": mask, "source": "synthetic"}) + "\n")
            total += length
            n += 1
    return out, n, total


def warm_up_prepared(prepared: Path, out: Path, n_tokens: int) -> Path:
    """The first samples of ``prepared`` up to about ``n_tokens`` tokens, under new ids (the warm-up run)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(prepared / META_FILE, out / META_FILE)
    total = 0
    with open(prepared / SAMPLES_FILE) as src, open(out / SAMPLES_FILE, "w") as dst:
        for line in src:
            row = json.loads(line)
            row["id"] = "warm-" + row["id"]
            dst.write(json.dumps(row) + "\n")
            total += len(row["input_ids"])
            if total >= n_tokens:
                break
    return out


def bare_server_main(port: int, total_bytes: int) -> None:
    """``python bench/serving.py --bare PORT BYTES``: one route streaming ``total_bytes``."""
    import numpy as np
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    block = memoryview(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())

    async def body() -> Any:
        left = total_bytes
        while left > 0:
            for i in range(0, len(block), BARE_CHUNK_BYTES):
                piece = block[i : i + min(BARE_CHUNK_BYTES, left)]
                left -= len(piece)
                yield piece
                if left <= 0:
                    return

    async def route(_request: Any) -> StreamingResponse:
        return StreamingResponse(body(), media_type="application/octet-stream")

    uvicorn.run(Starlette(routes=[Route("/", route)]), host="127.0.0.1", port=port, log_level="warning")


def bench_bare_stream(total_bytes: int) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bare", str(port), str(total_bytes)]
    proc = subprocess.Popen(cmd)  # noqa: S603 (our own script)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/nope", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        received = 0
        with httpx.Client(timeout=60) as client:  # built before the clock starts: the stream alone is timed
            server_cpu, client_cpu = process_cpu_s(proc.pid), process_cpu_s()
            started = time.perf_counter()
            with client.stream("GET", f"http://127.0.0.1:{port}/") as resp:
                for chunk in resp.iter_raw():
                    received += len(chunk)
            wall_s = time.perf_counter() - started
            server_cpu, client_cpu = process_cpu_s(proc.pid) - server_cpu, process_cpu_s() - client_cpu
    finally:
        proc.terminate()
        proc.wait(10)
    return {"bytes": received, "wall_s": wall_s, "mb_per_s": received / wall_s / 1e6,
            "cpu_s_per_gb": cpu_s_per_gb(server_cpu, client_cpu, received)}  # fmt: skip


def stage_seconds(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'eagle3_stage_seconds_total\{stage="(\w+)"\} (\S+)', text)}


def bench_codec_run(
    url: str,
    prepared: Path,
    out: Path,
    codec: str,
    raw_per_token: int,
    server_pid: int | None = None,
    recycle_buffers: bool = True,
) -> dict[str, Any]:
    before = stage_seconds(url)
    server_cpu = process_cpu_s(server_pid) if server_pid else 0.0
    client_cpu = process_cpu_s()
    config = ExtractConfig(codec=codec, progress=False, recycle_buffers=recycle_buffers)
    summary = extract_dataset(prepared, out, url, config=config)
    client_cpu = process_cpu_s() - client_cpu
    server_cpu = process_cpu_s(server_pid) - server_cpu if server_pid else 0.0
    after = stage_seconds(url)
    shutil.rmtree(out)
    raw_bytes = summary.n_tokens * raw_per_token
    return {
        "raw_mb_per_s": raw_bytes / summary.wall_s / 1e6,
        "tokens_per_s": summary.tokens_per_s,
        "wall_s": summary.wall_s,
        "n_tokens": summary.n_tokens,
        "wire_over_raw": summary.wire_bytes / raw_bytes,
        "server_stage_s": {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in after},
        "client_stage_s": {k: round(v, 3) for k, v in summary.stage_s.items()},
        **({"cpu_s_per_gb": cpu_s_per_gb(server_cpu, client_cpu, raw_bytes)} if server_pid else {}),
    }


def codec_rates() -> dict[str, dict[str, float]]:
    """Encode and decode MB/s of raw bytes on one core, and wire/raw, per codec (bf16 N(0, 3) bits)."""
    import numpy as np

    values = (np.random.default_rng(0).standard_normal(PROBE_BYTES // 2, dtype=np.float32) * 3.0).view(np.uint32)
    blob = (values >> 16).astype(np.uint16).tobytes()
    out = {}
    for name, codec in CODEC_NAMES.items():
        payload = encode_payload(blob, codec)
        started, n = time.perf_counter(), 0
        while time.perf_counter() - started < 0.3:
            decode_payload(payload, codec, len(blob))
            n += 1
        decode_mb_s = n * len(blob) / (time.perf_counter() - started) / 1e6
        out[name] = {
            "encode_mb_s_1_core": round(measure_encode_mb_s(codec, min_s=0.3), 1),
            "decode_mb_s_1_core": round(decode_mb_s, 1),
            "wire_over_raw": round(len(payload) / len(blob), 4),
        }
    return out


def hash_rates() -> dict[str, float]:
    import numpy as np
    import xxhash

    blob = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    rates = {}
    for name, make in (("sha256", hashlib.sha256), ("xxh3_128", xxhash.xxh3_128)):
        started = time.perf_counter()
        make(blob).hexdigest()
        rates[f"{name}_mb_s_1_core"] = round(len(blob) / (time.perf_counter() - started) / 1e6, 1)
    return rates


def run(hidden_size: int, n_tokens: int, p50: int, max_batch_tokens: int, tmp: Path) -> dict[str, Any]:
    prepared, n_samples, total = random_prepared(tmp / "prepared", n_tokens, p50)
    n_layers_out = 4  # 3 aux taps + the final state
    raw_per_token = n_layers_out * hidden_size * 2
    result: dict[str, Any] = {
        "backend": "synthetic",
        "hidden_size": hidden_size,
        "raw_bytes_per_token": raw_per_token,
        "n_samples": n_samples,
        "n_tokens": total,
        "raw_mb": total * raw_per_token / 1e6,
        "bare_stream": bench_bare_stream(total * raw_per_token),
    }
    args = ["--backend", "synthetic", "--synthetic-hidden-size", str(hidden_size)]
    args += ["--max-batch-tokens", str(max_batch_tokens), "--cache-memory-mb", "0"]  # every codec run computes
    with LocalServer(args, tmp / "server.log") as server:
        server.wait_ready(timeout_s=600)
        info = httpx.get(server.url + "/v1/info", timeout=10).json()
        result["server_codec_auto"] = info.get("codec_auto")
        # untimed warm-up of the same size (same server, same client process): the first run of a fresh
        # process pays one-off costs (the heap growing to the working set: page faults of first-time
        # buffers; lazy imports) that a long extraction pays once, and would land on the first codec
        warm = warm_up_prepared(prepared, tmp / "warm", total)
        pid = server.process.pid if server.process is not None else None
        warm_run = bench_codec_run(server.url, warm, tmp / "out-warm", "none", raw_per_token, pid)
        result["warm_up_none_mb_per_s"] = warm_run["raw_mb_per_s"]
        runs = {codec: bench_codec_run(server.url, prepared, tmp / f"out-{codec}", codec, raw_per_token, pid)
                for codec in ("none", "auto", "zstd+planes")}  # fmt: skip
        # the client's buffer pool off, side by side (fresh memory for every frame, as before the pool)
        runs["none, fresh buffers"] = bench_codec_run(
            server.url, prepared, tmp / "out-none-fresh", "none", raw_per_token, pid, recycle_buffers=False
        )
        result["server_peak_rss_mb"] = server.peak_rss_bytes() / 2**20
    result["codecs"] = runs
    bare = result["bare_stream"]["mb_per_s"]
    none = runs["none"]["raw_mb_per_s"]
    result["none_over_bare"] = none / bare
    # the same comparison in work instead of time: CPU seconds per GB of the none path over the bare stream's
    result["none_cpu_over_bare"] = (
        runs["none"]["cpu_s_per_gb"]["total"] / result["bare_stream"]["cpu_s_per_gb"]["total"]
    )
    result["default_over_none"] = runs["auto"]["raw_mb_per_s"] / none
    result["bars"] = {
        "none_over_bare>=0.6": none / bare >= 0.6,
        "default_over_none>=0.5": result["default_over_none"] >= 0.5,
    }
    result["codec_rates"] = codec_rates()
    result["hash_rates"] = hash_rates()
    return result


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--bare":
    bare_server_main(int(sys.argv[2]), int(sys.argv[3]))
