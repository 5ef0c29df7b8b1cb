"""Magpie-style self-instruct: user prompts sampled from the verifier itself, for on-policy distillation.

The verifier is fed only the chat template's user-turn prefix (the default system turn, then
``<|im_start|>user\\n``) and sampled (temperature, top-p, seeded) until ``<|im_end|>``. Kept prompts
are complete (ended by ``<|im_end|>``), ``min_tokens..max_tokens`` content tokens long, not degenerate
(at least half their tokens distinct, some letters) and distinct after normalisation (case,
punctuation, whitespace) from each other and from ``exclude`` (e.g. every evaluation prompt).
``write_prompt_dir`` stores them as a prepared directory whose samples are the rendered prompt plus
one placeholder supervised token (``<|im_end|>``), so ``distill.regenerate`` answers them unchanged.

Invariants: the same model, config and seed give the same prompts; prompt ids are the chat
template's rendering with the generation prompt (the tokens ``eagle3 prepare`` would produce).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.protocol.prepared import META_FILE, SAMPLES_FILE, STATS_FILE, PreparedMeta, PreparedSample

IM_END = "<|im_end|>"


@dataclass(frozen=True)
class SelfInstructConfig:
    n_prompts: int = 64
    batch_size: int = 64  # sequences sampled per generate call
    max_batches: int = 0  # 0: up to 4 * n_prompts / batch_size + 1 calls
    temperature: float = 1.0
    top_p: float = 0.95
    min_tokens: int = 4  # content tokens of a kept prompt (without the end token)
    max_tokens: int = 40
    seed: int = 0
    threads: int = 2


def normalize(text: str) -> str:
    """The dedupe key: lower case, letters and digits only, single spaces."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def is_acceptable(content_ids: list[int], text: str, min_tokens: int, max_tokens: int) -> bool:
    """Length in range, >= half the tokens distinct (no degenerate repeats), and some letters."""
    n_tokens = len(content_ids)
    if not min_tokens <= n_tokens <= max_tokens:
        return False
    return 2 * len(set(content_ids)) >= n_tokens and re.search(r"[A-Za-z]{2}", text) is not None


def user_prefix_text(tokenizer: Any) -> str:
    """The template's rendering up to the start of the first user message's content."""
    marker = "\x00USER\x00"
    text = str(tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False))
    return text[: text.index(marker)]


def render_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt ids of one user turn with the generation prompt (as ``eagle3 prepare`` tokenizes)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return list(tokenizer(str(rendered), add_special_tokens=False)["input_ids"])


def sample_prompts(model_dir: str | Path, cfg: SelfInstructConfig, exclude: Iterable[str] = ()) -> list[str]:
    """Up to ``cfg.n_prompts`` distinct user prompts sampled from the model at ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    end_id = int(tokenizer.convert_tokens_to_ids(IM_END))
    prefix = tokenizer(user_prefix_text(tokenizer), add_special_tokens=False)["input_ids"]
    seen = {normalize(t) for t in exclude}
    kept: list[str] = []
    max_batches = cfg.max_batches or 4 * cfg.n_prompts // cfg.batch_size + 1
    for batch_index in range(max_batches):
        torch.manual_seed(cfg.seed * 100_003 + batch_index)
        ids = torch.tensor([prefix] * cfg.batch_size)  # [B, P], identical rows: no padding
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=cfg.temperature,
                top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.max_tokens + 1, eos_token_id=end_id, pad_token_id=end_id,
            )[:, len(prefix) :]  # [B, <= max_tokens + 1]  # fmt: skip
        for row in out.tolist():
            if end_id not in row:
                continue  # ran past max_tokens: incomplete
            content = row[: row.index(end_id)]
            text = tokenizer.decode(content).strip()
            key = normalize(text)
            if key and key not in seen and is_acceptable(content, text, cfg.min_tokens, cfg.max_tokens):
                seen.add(key)
                kept.append(text)
        if len(kept) >= cfg.n_prompts:
            break
    return kept[: cfg.n_prompts]


def diversity_stats(texts: list[str], tokenizer: Any) -> dict[str, float]:
    """Prompt-diversity figures: count, mean content tokens, distinct-1/-2 (distinct n-grams / n-grams)."""
    token_rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    unigrams = [tok for row in token_rows for tok in row]
    bigrams = [tuple(row[i : i + 2]) for row in token_rows for i in range(len(row) - 1)]
    first_words = {t.split()[0].lower() for t in texts if t.split()}
    return {
        "n_prompts": len(texts),
        "mean_tokens": round(len(unigrams) / max(1, len(texts)), 2),
        "distinct_tokens": len(set(unigrams)),
        "distinct_1": round(len(set(unigrams)) / max(1, len(unigrams)), 4),
        "distinct_2": round(len(set(bigrams)) / max(1, len(bigrams)), 4),
        "distinct_first_words": len(first_words),
    }


def write_prompt_dir(texts: list[str], out_dir: str | Path, model_dir: str | Path, meta: PreparedMeta) -> Path:
    """A prepared directory of ``texts`` (ids ``si-00000``...) with one placeholder supervised token each."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    end_id = int(tokenizer.convert_tokens_to_ids(IM_END))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (SAMPLES_FILE + ".partial")
    with open(tmp, "w") as fh:
        for i, text in enumerate(texts):
            prompt = render_prompt(tokenizer, text)
            fh.write(PreparedSample(f"si-{i:05d}", [*prompt, end_id], [0] * len(prompt) + [1], source=text).to_json())
            fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / SAMPLES_FILE)
    (out / META_FILE).write_text(meta.to_json())
    stats = {"samples_kept": len(texts), "source": "self-instruct", **diversity_stats(texts, tokenizer)}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return out
