"""The GPU bars of issue 12 in one command: an 8B-shaped random verifier, ~120k tokens of chat-length
samples, the hf backend; (a) the naive loop, (b) the backend in-process, (c) ``eagle3 serve`` ->
``extract_dataset`` -> disk (default codec, and ``zstd+planes``); c/b, c/a and the server's RSS after load.

    .venv/bin/python bench/gpu_extract.py                                  # H200: ~4 min of GPU time
    .venv/bin/python bench/gpu_extract.py --model dummy:tiny --tokens 3000 --device cpu   # a CPU smoke run

No checkpoint is needed: ``--model dummy:<shape>`` builds the architecture with seeded random weights
directly on the device (server/backends/dummy_model.py), with SmolLM2's tokenizer. Samples are random
token ids with log-normal lengths around ``--p50`` (bench/serving.py). Prints one JSON object.
Bars (issue 12, GPU host): c/b >= 0.90, c/a >= 1.5, server RSS after load <= 4 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.extract import pack_by_tokens  # noqa: E402
from bench.serving import random_prepared  # noqa: E402
from eagle3.client.extract import ExtractConfig, extract_dataset  # noqa: E402
from eagle3.core.layers import default_aux_layer_ids  # noqa: E402
from eagle3.core.protocol import iter_prepared  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402
from eagle3.server.backends.base import BackendConfig  # noqa: E402
from eagle3.server.backends.dummy_model import dummy_config  # noqa: E402
from eagle3.server.backends.hf import HfBackend  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_naive(model: str, samples: list[list[int]], batch_size: int, device: str) -> dict[str, Any]:
    """What a user writes: LlamaForCausalLM, padded batches in arrival order, output_hidden_states."""
    from transformers import LlamaForCausalLM

    config = dummy_config(model, 49152)
    n_layers = int(config.num_hidden_layers)
    taps = (*default_aux_layer_ids(n_layers), n_layers)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        lm = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    real = padded = 0
    sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(samples), batch_size):
            batch = samples[i : i + batch_size]
            width = max(map(len, batch))
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, s in enumerate(batch):
                ids[row, : len(s)] = torch.tensor(s)
                mask[row, : len(s)] = 1
            out = lm(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            states = torch.stack([out.hidden_states[k] for k in taps], dim=2)  # [B, T, L, H]
            for row, s in enumerate(batch):
                states[row, : len(s)].cpu()
            real += sum(map(len, batch))
            padded += len(batch) * width
    sync(device)
    wall_s = time.perf_counter() - started
    del lm
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": real / wall_s, "wall_s": wall_s, "padding_waste": 1 - real / padded}


def bench_backend(model: str, samples: list[list[int]], max_batch_tokens: int, device: str) -> dict[str, Any]:
    backend = HfBackend(BackendConfig(model=model, max_batch_tokens=max_batch_tokens, device=device))
    backend.load(lambda _p, _f: None)
    batches = pack_by_tokens(samples, max_batch_tokens)
    started = time.perf_counter()
    for batch in batches:
        backend.extract(batch)
    wall_s = time.perf_counter() - started
    backend.close()
    return {"tokens_per_s": sum(map(len, samples)) / wall_s, "wall_s": wall_s, "n_forward_batches": len(batches)}


def bench_http(model: str, prepared: Path, tmp: Path, max_batch_tokens: int, device: str) -> dict[str, Any]:
    args = ["--model", model, "--backend", "hf", "--device", device, "--max-batch-tokens", str(max_batch_tokens)]
    args += ["--cache-memory-mb", "0"]  # the verifier's path: repeats of the same samples must not hit a cache
    out: dict[str, Any] = {}
    with LocalServer(args, tmp / "server.log") as server:
        server.wait_ready(timeout_s=900)
        out["server_rss_after_load_mb"] = server.peak_rss_bytes() / 2**20
        for codec in (None, "zstd+planes"):
            summary = extract_dataset(prepared, tmp / f"f-{codec}", server.url, config=ExtractConfig(codec=codec))
            raw = summary.n_tokens * 4 * int(dummy_config(model, 49152).hidden_size) * 2
            out[codec or "default"] = {
                "tokens_per_s": summary.tokens_per_s,
                "raw_mb_per_s": raw / summary.wall_s / 1e6,
                "wire_over_raw": summary.wire_bytes / raw,
                "client_stage_s": summary.stage_s,
            }
        out["server_peak_rss_mb"] = server.peak_rss_bytes() / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=120_000)
    parser.add_argument("--p50", type=int, default=1024)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--naive-batch", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eagle3-gpu-bench-") as tmp_name:
        tmp = Path(tmp_name)
        prepared, n_samples, n_tokens = random_prepared(tmp / "prepared", args.tokens, args.p50)
        samples = [s.input_ids for s in iter_prepared(prepared)]
        a = bench_naive(args.model, samples, args.naive_batch, args.device)
        b = bench_backend(args.model, samples, args.max_batch_tokens, args.device)
        c = bench_http(args.model, prepared, tmp, args.max_batch_tokens, args.device)
        c_tps = c["default"]["tokens_per_s"]
        result = {
            "model": args.model,
            "device": args.device,
            "n_samples": n_samples,
            "n_tokens": n_tokens,
            "a_naive_padded": a,
            "b_backend_in_process": b,
            "c_http_to_disk": c,
            "c_over_b": c_tps / b["tokens_per_s"],
            "c_over_a": c_tps / a["tokens_per_s"],
            "bars": {
                "c_over_b>=0.90": c_tps / b["tokens_per_s"] >= 0.9,
                "c_over_a>=1.5": c_tps / a["tokens_per_s"] >= 1.5,
                "server_rss_after_load<=4GB": c["server_rss_after_load_mb"] <= 4096,
            },
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
