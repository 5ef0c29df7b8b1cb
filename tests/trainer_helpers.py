"""Helpers for the trainer's tests and the τ run: tiny random verifiers and in-process features.

``write_features`` runs the hf backend (``eagle3.server.backends.hf.HfBackend``) in this process and writes
a features directory with the SDK's ``FeaturesWriter``: the same bytes ``eagle3 extract`` would
write, without a server. It lives here (not in ``draft_trainer``) because the trainer never imports
``server``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from eagle3.core.features_writer import FeaturesWriter
from eagle3.core.protocol.features import FeaturesMeta
from eagle3.core.protocol.prepared import PreparedSample, iter_prepared
from eagle3.core.sample import ExtractedSample
from eagle3.draft_trainer.vocab import DraftVocab, build_draft_vocab, save_vocab
from eagle3.server.backends.base import BackendConfig
from eagle3.server.backends.hf import HfBackend


def tiny_llama_dir(
    out_dir: Path, *, hidden_size: int = 64, vocab_size: int = 97, n_layers: int = 4, seed: int = 0
) -> Path:
    """A random LlamaForCausalLM saved as safetensors (fp32), with a config like a real checkpoint's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def random_samples(
    n_samples: int, vocab_size: int, *, min_len: int = 8, max_len: int = 24, seed: int = 0
) -> list[PreparedSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_samples):
        n = int(rng.integers(min_len, max_len + 1))
        ids = [int(x) for x in rng.integers(3, vocab_size, size=n)]
        prompt = int(rng.integers(2, n // 2 + 1))
        out.append(PreparedSample(f"s{i}", ids, [0] * prompt + [1] * (n - prompt)))
    return out


def write_vocab(samples: Sequence[PreparedSample], out_dir: Path, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    """``eagle3 vocab`` of the samples' trained-on tokens (``loss_mask`` 1) into ``out_dir``."""
    counts = np.bincount([i for s in samples for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m],
                         minlength=vocab_size)  # fmt: skip
    vocab, stats = build_draft_vocab(counts, draft_vocab_size)
    save_vocab(vocab, stats, counts, out_dir)
    return vocab


def write_features(
    samples: Sequence[PreparedSample] | Path,
    out_dir: Path,
    model_dir: Path,
    *,
    dtype: str = "float32",
    shard_mb: float = 0.05,
    aux_layer_ids: tuple[int, ...] | None = (1, 2, 3),
) -> Path:
    """Extract ``samples`` (or a prepared dir) with an in-process hf backend into ``out_dir``.

    ``aux_layer_ids`` defaults to (1, 2, 3) for the 4-layer test models; None: the server's default."""
    if isinstance(samples, Path):
        samples = list(iter_prepared(samples))
    backend = HfBackend(BackendConfig(model=str(model_dir), aux_layer_ids=aux_layer_ids, dtype=dtype, device="cpu"))
    info = backend.load(lambda phase, fraction: None)
    meta = FeaturesMeta(
        model_id=info.model_id, revision=info.revision, aux_layer_ids=info.aux_layer_ids,
        final_layer_id=info.final_layer_id, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
        dtype="bfloat16", tokenizer_sha256=info.tokenizer_sha256, n_samples_total=len(samples),
    )  # fmt: skip
    writer = FeaturesWriter.open(out_dir, meta, shard_mb=shard_mb)
    for sample in samples:
        writer.add(extract_one(backend, sample))
    writer.close()
    backend.close()
    return out_dir


def extract_one(backend: HfBackend, sample: PreparedSample) -> ExtractedSample:
    """One sample through a loaded backend, alone (fp32: bitwise what the server sends), as bf16 bits."""
    assert backend.info is not None
    states = backend.extract([sample.input_ids])[0]  # [T, L, H]
    bits = states.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # [T, L, H] bf16 bits
    ids = np.asarray(sample.input_ids, dtype=np.int32)  # [T]
    mask = np.asarray(sample.loss_mask, dtype=np.uint8)  # [T]
    return ExtractedSample(sample.sample_id, ids, mask, bits, backend.info.aux_layer_ids, backend.info.final_layer_id)


def write_prepared(samples: Sequence[PreparedSample], out_dir: Path, model_dir: Path, vocab_size: int) -> Path:
    """A prepared directory (samples.jsonl + meta.json) for tests that go through eval's prompt selection."""
    from eagle3.core.protocol.prepared import PreparedMeta

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "samples.jsonl").write_text("".join(s.to_json() + "\n" for s in samples))
    meta = PreparedMeta(model=str(model_dir), model_dir=str(model_dir), tokenizer_sha256="", chat_template_sha256="",
                        vocab_size=vocab_size, max_length=256, overlong="drop", inputs=["test"])  # fmt: skip
    (out_dir / "meta.json").write_text(meta.to_json())
    (out_dir / "stats.json").write_text(json.dumps({"samples_kept": len(samples)}))
    return out_dir


def write_features_mix(
    distilled_features: Path, prepared: Path, out_dir: Path, model_dir: Path, *, heldout_fraction: float = 0.05
) -> tuple[int, int]:
    """``out_dir`` = every sample of ``distilled_features`` (copied) + the original answers of ``prepared``
    whose prompt is a *training-split* prompt of ``distilled_features`` (ids ``orig/<id>``), extracted
    in-process with the hf backend. The verifier stays the teacher on the original answers (its own
    distribution at each position), so they are more contexts, not other targets; prompts held out of
    ``distilled_features`` (its split) and prompts absent from it stay out of the mix, so both
    ``eagle3 eval`` prompt sets remain unseen. Returns (extra samples, extra tokens)."""
    import dataclasses
    import random

    from eagle3.core.features_reader import FeaturesReader
    from eagle3.core.protocol.prepared import is_heldout

    src = FeaturesReader(distilled_features)
    train_prompts: set[tuple[int, ...]] = set()
    for stored in src:
        mask = stored.loss_mask.tolist()
        if not is_heldout(stored.sample_id, heldout_fraction):
            train_prompts.add(tuple(stored.input_ids[: mask.index(1)].tolist()))
    extra = [s for s in iter_prepared(prepared) if tuple(s.input_ids[: s.loss_mask.index(1)]) in train_prompts]
    random.Random(0).shuffle(extra)
    meta = dataclasses.replace(src.meta, n_samples_total=len(src) + len(extra))
    writer = FeaturesWriter.open(out_dir, meta, shard_mb=64)
    for copied in src:
        writer.add(copied)
    backend = HfBackend(BackendConfig(model=str(model_dir), aux_layer_ids=None, dtype="float32", device="cpu"))
    info = backend.load(lambda phase, fraction: None)
    n_tokens = 0
    for sample in extra:
        states = backend.extract([sample.input_ids])[0]  # [T, L, H]
        bits = states.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # [T, L, H] bf16 bits
        ids = np.asarray(sample.input_ids, dtype=np.int32)  # [T]
        mask_u8 = np.asarray(sample.loss_mask, dtype=np.uint8)  # [T]
        writer.add(ExtractedSample(f"orig/{sample.sample_id}", ids, mask_u8, bits, info.aux_layer_ids,
                                   info.final_layer_id))  # fmt: skip
        n_tokens += len(sample.input_ids)
    writer.close()
    backend.close()
    return len(extra), n_tokens


def training_files(root: Path, n_samples: int, seed: int, hidden_size: int = 32) -> dict[str, str]:
    """A tiny verifier, random samples' features and a 64-id draft vocab under ``root``: the paths a
    TrainConfig needs (``features``, ``vocab``, ``model``)."""
    model = tiny_llama_dir(root / "model", hidden_size=hidden_size)
    samples = random_samples(n_samples, 97, seed=seed)
    features = write_features(samples, root / "features", model)
    write_vocab(samples, root / "vocab", 97, 64)
    return {"features": str(features), "vocab": str(root / "vocab"), "model": str(model)}
