"""Self-distillation data: the verifier's own greedy answers to the prompts of a prepared dataset.

A draft is judged by how often it proposes what the *verifier* would say next; training it on the
dataset's original responses teaches it what a human wrote instead. ``regenerate`` keeps each
sample's prompt (the tokens before its first supervised token) and replaces the rest with the
verifier's greedy continuation (up to ``max_new_tokens``, stopping at the EOS token, which is kept
and supervised). The result is a normal prepared directory (same ``meta.json``), so vocab, extract
and train read it unchanged.

This is the in-process variant (it loads the verifier itself). It lives in bench/, not in the package:
only ``bench/tau_run.py``, ``bench/distill.py`` (which times it against the server path) and the trainer's
tests use it. Pipelines and ``eagle3 demo`` distil through the resident server instead, without a second
load of the verifier: ``eagle3 distill --server URL`` (``eagle3.client.distill``, ``POST /v1/generate``),
which also regenerates later turns of multi-turn samples and resumes after a kill.

Invariants: every output sample has >= 1 supervised token; ``loss_mask`` is 1 exactly on the
generated tokens; output ids are ``<prompt id>-distill``; the samples file is written atomically.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from eagle3.core.protocol.prepared import META_FILE, SAMPLES_FILE, STATS_FILE, PreparedSample, iter_prepared, read_meta

logger = logging.getLogger(__name__)


def prompt_of(sample: PreparedSample) -> list[int]:
    """The tokens before the first supervised one (the rendered prompt, ending with the assistant header)."""
    return sample.input_ids[: sample.loss_mask.index(1)]


def select_prompts(prepared_dir: str | Path, max_samples: int) -> list[tuple[str, list[int]]]:
    """The first ``max_samples`` samples with a distinct prompt: ``(sample_id, prompt ids)``."""
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[str, list[int]]] = []
    for sample in iter_prepared(prepared_dir):
        prompt = prompt_of(sample)
        if tuple(prompt) in seen or not prompt:
            continue
        seen.add(tuple(prompt))
        out.append((sample.sample_id, prompt))
        if len(out) >= max_samples:
            break
    return out


def regenerate(
    prepared_dir: str | Path,
    out_dir: str | Path,
    model_dir: str | Path,
    max_samples: int = 640,
    max_new_tokens: int = 48,
    batch_size: int = 64,
) -> Path:
    """Write ``out_dir`` (a prepared directory) with verifier-greedy responses; returns ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    prepared_dir, out = Path(prepared_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos_id = int(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, int)
                 else model.generation_config.eos_token_id[0])  # fmt: skip
    pad_id = eos_id
    prompts = select_prompts(prepared_dir, max_samples)
    started = time.monotonic()
    tmp = out / (SAMPLES_FILE + ".partial")
    n_written = 0
    with open(tmp, "w") as fh:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for _, p in chunk)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for _, p in chunk])  # [B, T] left-padded
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p in chunk])  # [B, T]
            with torch.inference_mode():
                gen = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                    pad_token_id=pad_id, eos_token_id=eos_id,
                )[:, width:]  # [B, <= max_new_tokens]  # fmt: skip
            for (sample_id, prompt), row in zip(chunk, gen.tolist(), strict=True):
                answer = row[: row.index(eos_id) + 1] if eos_id in row else row
                sample = PreparedSample(f"{sample_id}-distill", prompt + answer, [0] * len(prompt) + [1] * len(answer),
                                        source=f"{prepared_dir} {sample_id} (verifier greedy)")  # fmt: skip
                fh.write(sample.to_json() + "\n")
                n_written += 1
            logger.info("distill: %d/%d samples, %.0f s", n_written, len(prompts), time.monotonic() - started)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / SAMPLES_FILE)
    meta = read_meta(prepared_dir)
    (out / META_FILE).write_text(meta.to_json())
    stats = {"samples_kept": n_written, "source": str(prepared_dir), "max_new_tokens": max_new_tokens,
             "generate_s": round(time.monotonic() - started, 1)}  # fmt: skip
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return out
