"""Training memory and speed against micro-batch size, on synthetic features (no verifier). Prints JSON.

    python -m bench.train --synthetic [--shapes smollm2,llama8b] [--tokens 2048,4096,8192,16384]
        [--attention blockwise,dense] [--device cpu|cuda] [--steps 2] [--threads 2]

Each (shape, tokens, attention) runs in its own process (so one run's peak cannot hide another's):
a random draft of the shape, a random teacher, a packed batch of random samples (lengths drawn
uniformly from 256..2048, the last one cut to fill exactly ``tokens``; first quarter of each sample
unsupervised), every teacher row in the draft vocab (all K x T terms counted: the most memory).
One warm-up step (CPU: AdamW's state allocated by a zero-gradient update instead), then ``--steps``
timed steps of ``ttt_forward`` + backward + AdamW, as in ``Trainer.train_step``. Peak memory of the step: CUDA
``max_memory_allocated`` minus what was allocated before it; CPU peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the RSS before it. ``dense`` runs whose estimated scores exceed ``--dense-
max-gb`` are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.draft_trainer import ttt_loss
from eagle3.draft_trainer.model import DraftConfig, EagleDraft
from eagle3.draft_trainer.ttt import PackedBatch, Teacher, ttt_forward

SHAPES: dict[str, dict[str, int]] = {  # verifier body -> the draft (one of its layers) and vocab sizes
    "smollm2": {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "vocab": 49152},
    "llama8b": {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336, "vocab": 128256},
}
DRAFT_VOCAB = 32000
TTT_STEPS = 7


def _model(shape: str, device: torch.device) -> tuple[EagleDraft, Teacher]:
    s = SHAPES[shape]
    cfg = DraftConfig(hidden_size=s["hidden"], target_hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      draft_vocab_size=DRAFT_VOCAB, target_vocab_size=s["vocab"], aux_layer_ids=(1, 2, 3))  # fmt: skip
    torch.manual_seed(0)
    draft = EagleDraft(cfg)
    d2t = torch.arange(DRAFT_VOCAB) * (s["vocab"] // DRAFT_VOCAB) - torch.arange(DRAFT_VOCAB)  # spread ids
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[torch.arange(DRAFT_VOCAB) + d2t] = True
    draft.set_vocab(d2t, t2d)
    draft.embed_tokens.normal_()
    teacher = Teacher(torch.ones(s["hidden"]), torch.randn(s["vocab"], s["hidden"]) * 0.05, cfg.rms_norm_eps)
    return draft.to(device), teacher.to(device)


def _batch(shape: str, tokens: int, device: torch.device) -> PackedBatch:
    g = torch.Generator().manual_seed(tokens)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(256, 2049, (1,), generator=g)), tokens - sum(lengths)))
    starts = torch.cat([torch.full((m,), sum(lengths[:i])) for i, m in enumerate(lengths)])
    ends = starts + torch.cat([torch.full((m,), m) for m in lengths])
    positions = torch.cat([torch.arange(m) for m in lengths])
    hidden, vocab = SHAPES[shape]["hidden"], SHAPES[shape]["vocab"]
    batch = PackedBatch(input_ids=torch.randint(0, vocab, (tokens,), generator=g),
                        aux=torch.randn(tokens, 3 * hidden, generator=g),
                        final=torch.randn(tokens, hidden, generator=g),
                        loss_mask=positions >= (ends - starts) // 4, positions=positions, seg_start=starts,
                        seg_end=ends)  # fmt: skip
    return batch.to(device)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_one(shape: str, tokens: int, attention: str, device_name: str, steps: int, loss_chunk: int = 0,
            profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """One configuration in this process: warm-up step, then ``steps`` timed steps (then one profiled)."""
    device = torch.device(device_name)
    if loss_chunk:
        ttt_loss.CUDA_LOSS_CHUNK_ELEMENTS = loss_chunk
    draft, teacher = _model(shape, device)
    batch = _batch(shape, tokens, device)
    in_vocab = torch.ones(tokens, dtype=torch.bool, device=device)
    log_mass = torch.zeros(tokens, device=device)  # cached teacher stats (the trainer caches them per sample)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    cuda = device.type == "cuda"

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            result = ttt_forward(
                draft,
                teacher,
                batch,
                TTT_STEPS,
                teacher_in_vocab=in_vocab,
                attention=attention,
                teacher_log_mass=log_mass,
            )
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return float(result.n_terms.sum())

    if cuda:
        step()  # warm-up: AdamW state allocated, kernels compiled
    else:  # CPU: allocate AdamW's state with a zero-gradient update instead of a full (minutes-long) step
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        base = _rss_kb("VmRSS") * 1024
    started = time.perf_counter()
    for _ in range(steps):
        terms = step()
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _rss_kb("VmHWM") * 1024
    step_s = (time.perf_counter() - started) / steps
    out = {"shape": shape, "tokens": tokens, "attention": attention, "step_s": round(step_s, 3),
           "tokens_per_s": round(tokens / step_s, 1), "step_peak_mb": round((peak - base) / 2**20, 1),
           "peak_mb": round(peak / 2**20, 1), "terms": terms,
           "cuda_loss_chunk_elements": ttt_loss.CUDA_LOSS_CHUNK_ELEMENTS}  # fmt: skip
    if profile:
        out["profile"] = _profile(step, cuda)
    return out


def _profile(step: Any, cuda: bool, top: int = 25) -> dict[str, Any]:
    """One step under torch.profiler: device busy time vs wall, and the ops with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy_us = sum(getattr(e, key) for e in events)
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return {"wall_s": round(wall_s, 3), "self_time_total_s": round(busy_us / 1e6, 3),
            "top": [{"op": e.key[:80], "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 1)}
                    for e in ranked]}  # fmt: skip


def _dense_gb(shape: str, tokens: int) -> float:
    """Rough bytes the dense path keeps: ~4 fp32 [nh, T, T] tensors per TTT step."""
    return TTT_STEPS * 4 * SHAPES[shape]["heads"] * tokens * tokens * 4 / 2**30


def main(args: argparse.Namespace) -> int:
    if args.one:
        torch.set_num_threads(args.threads)
        shape, tokens, attention, chunk = args.one.split(":")
        print(json.dumps(run_one(shape, int(tokens), attention, args.device, args.steps, int(chunk), args.profile)))
        return 0
    runs: list[dict[str, Any]] = []
    chunks = args.loss_chunk.split(",")
    for shape in args.shapes.split(","):
        for attention in args.attention.split(","):
            for tokens, chunk in ((int(t), int(c or 0)) for t in args.tokens.split(",") for c in chunks):
                if attention == "dense" and _dense_gb(shape, tokens) > args.dense_max_gb:
                    skipped = f"dense scores ~{_dense_gb(shape, tokens):.0f} GB > --dense-max-gb"
                    runs.append({"shape": shape, "tokens": tokens, "attention": attention, "skipped": skipped})
                    continue
                cmd = [sys.executable, "-m", "bench.train", "--synthetic", "--one",
                       f"{shape}:{tokens}:{attention}:{chunk}", "--device", args.device, "--steps", str(args.steps),
                       "--threads", str(args.threads)] + (["--profile"] if args.profile else [])  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)  # noqa: S603 (our own argv)
                if done.returncode != 0:
                    failed = done.stderr.strip().splitlines()[-1:] or [f"rc {done.returncode}"]
                    runs.append({"shape": shape, "tokens": tokens, "attention": attention, "failed": failed})
                else:
                    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "train_scaling", "device": args.device, "torch": torch.__version__,
                      "cpu": platform.machine(), "torch_threads": args.threads, "ttt_steps": TTT_STEPS,
                      "draft_vocab_size": DRAFT_VOCAB, "steps": args.steps, "runs": runs,
                      "ratios": ratios(runs)}, indent=1))  # fmt: skip
    return 0


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (shape, attention[, CUDA loss chunk]): step peak at 16k / at 4k and step time at 8k / at 4k (the bars)."""
    out: dict[str, Any] = {}
    timed = [r for r in runs if "step_s" in r]
    chunks = {r["cuda_loss_chunk_elements"] for r in timed}

    def label(r: dict[str, Any]) -> str:
        tail = f"/chunk{r['cuda_loss_chunk_elements']}" if len(chunks) > 1 else ""
        return f"{r['shape']}/{r['attention']}{tail}"

    by_key = {(label(r), r["tokens"]): r for r in timed}
    for name in sorted({label(r) for r in timed}):
        at = {t: by_key.get((name, t)) for t in (4096, 8192, 16384)}
        entry = {}
        if at[4096] and at[16384]:
            entry["peak_16k_over_4k"] = round(at[16384]["step_peak_mb"] / at[4096]["step_peak_mb"], 2)
        if at[4096] and at[8192]:
            entry["step_time_8k_over_4k"] = round(at[8192]["step_s"] / at[4096]["step_s"], 2)
        out[name] = entry
    return out
