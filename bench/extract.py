"""Extraction throughput, side by side in one run on the same tokens and the same verifier.

    (a) naive: what a user writes first: transformers, padded batches of N samples in arrival order,
        ``output_hidden_states=True``, states copied to CPU;
    (b) the hf backend in-process, batches packed by the token budget (no HTTP, no disk);
    (c) eagle3 end to end: a live ``eagle3 serve`` subprocess, ``extract_dataset`` over HTTP to shards.
    With ``--vllm``, also:
    (d) vLLM offline extraction to files the way peers do it: ``vllm.LLM`` with the
        ``extract_hidden_states`` method and the hidden-states connector (eagle3's CPU-safe subclass of
        the stock one, same files) writing one safetensors per request to a directory on disk, all
        prompts in one ``generate`` call; done when every file's write lock is released;
    (e) eagle3 with ``--backend vllm`` end to end through HTTP to disk, like (c).

Prints one JSON object: tokens/s of each, c/b and c/a, the padding waste of (a), wire bytes per token
against raw bf16, zstd speed against the extraction rate, and the server's peak RSS when extracting
1x and 4x the dataset (a fresh server each; streaming must keep it flat).

    .venv/bin/python bench/extract.py                   # ~20k tokens of the demo data, ~6 min here
    .venv/bin/python bench/extract.py --tokens 5000     # quicker look
    .venv/bin/python bench/extract.py --tokens 10000 --vllm   # + (d) and (e): e/d and e/c
    .venv/bin/python bench/extract.py --data mixed      # multi-turn conversations of 1-8 chained dialogs
    .venv/bin/python bench/extract.py --backend synthetic --hidden-size 4096   # the serving path alone:
        # per codec raw MB/s, per-stage seconds, a bare HTTP stream of the same bytes (bench/serving.py)

``--data chatterbot`` (default) is the demo's data: single exchanges of ~50 tokens, nearly equal in
length, the best case for (a)'s padding. ``--data mixed`` chains 1-8 chatterbot dialogs (seeded) into
multi-turn conversations, a spread of lengths like real chat SFT sets (~40-500 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.client.extract import ExtractConfig, extract_dataset  # noqa: E402
from eagle3.client.prepare import PrepareConfig, prepare_dataset  # noqa: E402
from eagle3.core.codec import encode_payload  # noqa: E402
from eagle3.core.conversations import BUILTIN_CHATTERBOT  # noqa: E402
from eagle3.core.layers import default_aux_layer_ids  # noqa: E402
from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from eagle3.core.protocol import META_FILE, SAMPLES_FILE, iter_prepared  # noqa: E402
from eagle3.core.protocol.frames import CODEC_NAMES  # noqa: E402
from eagle3.local_server import LocalServer  # noqa: E402
from eagle3.server.backends.base import BackendConfig  # noqa: E402
from eagle3.server.backends.hf import HfBackend  # noqa: E402


def mixed_conversations(path: Path, seed: int = 0) -> Path:
    """chatterbot dialogs chained 1-8 at a time (seeded) into multi-turn conversations, as JSONL."""
    import random

    from eagle3.core.conversations import iter_rows, parse_row

    base = [parse_row(r.row or {}, r.location) for r in iter_rows(BUILTIN_CHATTERBOT)]
    rng = random.Random(seed)  # noqa: S311 (a reproducible data mix, not security)
    with open(path, "w") as fh:
        i = 0
        while i < len(base):
            n = rng.randint(1, 8)
            messages = [m.as_dict() for c in base[i : i + n] for m in c.messages]
            fh.write(json.dumps({"messages": messages}) + "\n")
            i += n
    return path


def subset(prepared: Path, out: Path, max_tokens: int, repeat: int = 1) -> tuple[list[list[int]], Path]:
    """The first samples of ``prepared`` up to ``max_tokens`` tokens, ``repeat`` times under new ids."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(prepared / META_FILE, out / META_FILE)
    rows, n_tokens = [], 0
    for sample in iter_prepared(prepared):
        if n_tokens + sample.n_tokens > max_tokens:
            break
        rows.append(sample)
        n_tokens += sample.n_tokens
    with open(out / SAMPLES_FILE, "w") as f:
        for r in range(repeat):
            for s in rows:
                line = {
                    "id": f"{s.sample_id}~{r}",
                    "input_ids": s.input_ids,
                    "loss_mask": s.loss_mask,
                    "source": s.source,
                }
                f.write(json.dumps(line) + "\n")
    return [s.input_ids for s in rows] * repeat, out


def bench_naive(model_dir: Path, samples: list[list[int]], batch_size: int, aux: tuple[int, ...]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    pad = 0
    real, padded = 0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(samples), batch_size):
            batch = samples[i : i + batch_size]
            width = max(len(s) for s in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, T]
            mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            for row, s in enumerate(batch):
                ids[row, : len(s)] = torch.tensor(s)
                mask[row, : len(s)] = 1
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            states = torch.stack([out.hidden_states[k] for k in (*aux, -1)], dim=2)  # [B, T, L, H]
            for row, s in enumerate(batch):
                states[row, : len(s)].cpu().clone()  # what the user keeps per sample
            real += sum(len(s) for s in batch)
            padded += len(batch) * width
    wall_s = time.perf_counter() - started
    return {
        "tokens_per_s": real / wall_s,
        "wall_s": wall_s,
        "padding_waste": 1 - real / padded,
        "batch_size": batch_size,
    }


def pack_by_tokens(samples: list[list[int]], max_batch_tokens: int) -> list[list[list[int]]]:
    """Consecutive samples in batches of at most ``max_batch_tokens`` tokens (a longer sample alone)."""
    batches: list[list[list[int]]] = [[]]
    for s in samples:
        if batches[-1] and sum(map(len, batches[-1])) + len(s) > max_batch_tokens:
            batches.append([])
        batches[-1].append(s)
    return batches


def bench_backend(model_dir: Path, samples: list[list[int]], max_batch_tokens: int) -> dict[str, Any]:
    backend = HfBackend(BackendConfig(model=str(model_dir), max_batch_tokens=max_batch_tokens))
    backend.load(lambda _phase, _fraction: None)
    batches = pack_by_tokens(samples, max_batch_tokens)
    started = time.perf_counter()
    first: torch.Tensor | None = None
    for batch in batches:
        states = backend.extract(batch)
        first = states[0] if first is None else first
    wall_s = time.perf_counter() - started
    backend.close()
    n_tokens = sum(map(len, samples))
    return {"tokens_per_s": n_tokens / wall_s, "wall_s": wall_s, "n_forward_batches": len(batches), "_first": first}


def bench_http(
    model_dir: Path, prepared: Path, out: Path, max_batch_tokens: int, codec: str | None, backend: str = "hf"
) -> dict[str, Any]:
    args = ["--model", str(model_dir), "--backend", backend, "--max-batch-tokens", str(max_batch_tokens)]
    args += ["--cache-memory-mb", "0"]  # each run computes its states (the cache has bench/cache_repeat.py)
    with LocalServer(args, out.parent / f"{out.name}.server.log") as server:
        server.wait_ready(timeout_s=600)
        rss_ready = server.peak_rss_bytes()
        summary = extract_dataset(prepared, out, server.url, config=ExtractConfig(codec=codec, progress=False))
        rss_peak = server.peak_rss_bytes()
    return {
        "tokens_per_s": summary.tokens_per_s,
        "wall_s": summary.wall_s,
        "n_tokens": summary.n_tokens,
        "n_samples": summary.n_samples,
        "wire_bytes": summary.wire_bytes,
        "disk_bytes": summary.bytes_on_disk,
        "server_rss_ready_mb": rss_ready / 2**20,
        "server_peak_rss_mb": rss_peak / 2**20,
    }


def vllm_offline_child(
    model_dir: str, samples: list[list[int]], max_batch_tokens: int, out_dir: str, queue: Any
) -> None:
    """(d), in a spawned process so its engine is gone before (e) starts one."""
    import fcntl

    os.dup2(2, 1)  # vLLM logs to stdout: keep the parent's stdout for the JSON result

    import vllm
    from transformers import AutoConfig

    from eagle3.server.backends.vllm_settings import engine_kwargs, export_package_root

    n_layers = int(AutoConfig.from_pretrained(model_dir).num_hidden_layers)
    config = BackendConfig(model=model_dir, max_batch_tokens=max_batch_tokens)
    max_len = int(AutoConfig.from_pretrained(model_dir).max_position_embeddings)
    kwargs = engine_kwargs(
        config, Path(model_dir), [*default_aux_layer_ids(n_layers), n_layers], max_len, "cpu", out_dir
    )
    export_package_root()
    llm = vllm.LLM(**kwargs)
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    warmup: list[Any] = [{"prompt_token_ids": [1, 2, 3]}]
    prompts: list[Any] = [{"prompt_token_ids": ids} for ids in samples]
    llm.generate(warmup, params, use_tqdm=False)  # warm-up, like the server's
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        with open((output.kv_transfer_params or {})["hidden_states_path"] + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # the connector holds LOCK_EX until the file is written
    wall_s = time.perf_counter() - started
    disk = sum(f.stat().st_size for f in Path(out_dir).rglob("*.safetensors"))
    n_tokens = sum(map(len, samples))
    queue.put({"tokens_per_s": n_tokens / wall_s, "wall_s": wall_s, "n_files": len(outputs), "disk_bytes": disk})
    queue.close()
    queue.join_thread()  # the result is in the pipe
    import psutil  # type: ignore[import-untyped]  # a vllm dependency

    for child in psutil.Process().children(recursive=True):  # the engine core and its workers: GBs each
        child.kill()
    os._exit(0)  # without waiting on vLLM's shutdown at interpreter exit (it would hang or linger)


def bench_vllm_offline(model_dir: Path, samples: list[list[int]], max_batch_tokens: int, out: Path) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    out.mkdir(parents=True, exist_ok=True)
    proc = ctx.Process(target=vllm_offline_child, args=(str(model_dir), samples, max_batch_tokens, str(out), queue))
    proc.start()
    result: dict[str, Any] = queue.get(timeout=1800)
    proc.join(120)
    if proc.is_alive():
        proc.kill()
    return result


def zstd_speed(states: torch.Tensor, codec: str) -> dict[str, float]:
    from safetensors.torch import save

    blob = save({"hidden_states": states.contiguous()})
    started = time.perf_counter()
    repeats = max(1, int(64e6 // len(blob)))
    for _ in range(repeats):
        payload = encode_payload(blob, CODEC_NAMES[codec])
    wall_s = time.perf_counter() - started
    return {"compress_mb_per_s_1_thread": repeats * len(blob) / wall_s / 1e6, "ratio": len(blob) / len(payload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=20000, help="tokens of demo data per 1x run")
    parser.add_argument("--naive-batch", type=int, default=8, help="samples per padded batch in (a)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--codec", default=None, help="wire codec (default: the server's)")
    parser.add_argument("--scale", type=int, default=4, help="the larger dataset for the RSS check, in x")
    parser.add_argument("--data", choices=("chatterbot", "mixed"), default="chatterbot", help="see the docstring")
    parser.add_argument("--vllm", action="store_true", help="also (d) vLLM offline to files and (e) --backend vllm")
    parser.add_argument("--backend", choices=("hf", "synthetic"), default="hf", help="synthetic: bench/serving.py")
    parser.add_argument("--hidden-size", type=int, default=4096, help="synthetic: states' hidden size")
    parser.add_argument("--p50", type=int, default=1024, help="synthetic: median sample length in tokens")
    args = parser.parse_args()
    if args.backend == "synthetic":
        from bench.serving import run

        with tempfile.TemporaryDirectory(prefix="eagle3-bench-serving-") as tmp_name:
            tokens = args.tokens if "--tokens" in sys.argv else 20000
            print(json.dumps(run(args.hidden_size, tokens, args.p50, args.max_batch_tokens, Path(tmp_name)), indent=2))
        return
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = resolve_model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="eagle3-bench-") as tmp_name:
        tmp = Path(tmp_name)
        sources = BUILTIN_CHATTERBOT if args.data == "chatterbot" else [str(mixed_conversations(tmp / "mixed.jsonl"))]
        prepare_dataset(sources, tmp / "full", model=str(model_dir), config=PrepareConfig())
        samples, one_x = subset(tmp / "full", tmp / "p1", args.tokens)
        _, n_x = subset(tmp / "full", tmp / f"p{args.scale}", args.tokens, repeat=args.scale)
        from transformers import AutoConfig

        n_layers = int(AutoConfig.from_pretrained(model_dir).num_hidden_layers)
        hidden = int(AutoConfig.from_pretrained(model_dir).hidden_size)
        aux = default_aux_layer_ids(n_layers)
        n_tokens = sum(map(len, samples))

        a = bench_naive(model_dir, samples, args.naive_batch, aux)
        b = bench_backend(model_dir, samples, args.max_batch_tokens)
        first = b.pop("_first")
        c = bench_http(model_dir, one_x, tmp / "f1", args.max_batch_tokens, args.codec)
        c_n = bench_http(model_dir, n_x, tmp / f"f{args.scale}", args.max_batch_tokens, args.codec)
        raw_per_token = (len(aux) + 1) * hidden * 2
        codec = args.codec if args.codec not in (None, "auto", "none") else "zstd+planes"  # the codec measured below
        z = zstd_speed(first, codec)
        extraction_mb_s = c["tokens_per_s"] * raw_per_token / 1e6
        result = {
            "model": str(args.model),
            "data": args.data,
            "n_samples": len(samples),
            "n_tokens": n_tokens,
            "threads": torch.get_num_threads(),
            "a_naive_padded": a,
            "b_backend_in_process": b,
            "c_http_to_disk": c,
            "c_over_b": c["tokens_per_s"] / b["tokens_per_s"],
            "c_over_a": c["tokens_per_s"] / a["tokens_per_s"],
            "wire_bytes_per_token": c["wire_bytes"] / c["n_tokens"],
            "raw_bf16_bytes_per_token": raw_per_token,
            "wire_over_raw": c["wire_bytes"] / (c["n_tokens"] * raw_per_token),
            "codec": args.codec or "server default (auto: none on loopback)",  # what (c) used on the wire
            "zstd_codec": codec,
            "zstd": z,
            "zstd_over_extraction_rate": z["compress_mb_per_s_1_thread"] / extraction_mb_s,
            f"server_peak_rss_mb_{args.scale}x": c_n["server_peak_rss_mb"],
            "server_peak_rss_mb_1x": c["server_peak_rss_mb"],
            f"c_http_to_disk_{args.scale}x": c_n,
        }
        if args.vllm:
            d = bench_vllm_offline(model_dir, samples, args.max_batch_tokens, tmp / "d")
            e = bench_http(model_dir, one_x, tmp / "fe", args.max_batch_tokens, args.codec, backend="vllm")
            result |= {"d_vllm_offline_to_files": d, "e_vllm_http_to_disk": e}
            result["e_over_d"] = e["tokens_per_s"] / d["tokens_per_s"]
            result["e_over_c"] = e["tokens_per_s"] / c["tokens_per_s"]
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
