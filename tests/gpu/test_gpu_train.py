"""The draft trainer on CUDA: a short run from features made on the spot (hf backend in-process, tiny
random Llama), loss decreases, and the first step's loss on CUDA matches the CPU run's (fp32: tight,
bf16 autocast: bf16 tolerance). Prints a JSON line with the CUDA run's tokens/s.

Self-sufficient: marked ``gpu`` and skipped without CUDA (``make test`` deselects ``gpu`` anyway).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft_trainer.config import TrainConfig
from eagle3.draft_trainer.train import METRICS_FILE, Trainer, train
from eagle3.draft_trainer.vocab import build_draft_vocab, save_vocab
from tests.trainer_helpers import random_samples, tiny_llama_dir, write_features

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run on a GPU host (tests/gpu/run.sh)"),
]
VOCAB_SIZE = 97


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    root = tmp_path_factory.mktemp("gpu_train")
    model = tiny_llama_dir(root / "model", hidden_size=64)
    _sharpen_lm_head(model, 30.0)
    samples = random_samples(64, VOCAB_SIZE, seed=5)
    features = write_features(samples, root / "features", model)
    counts = np.bincount(
        [i for s in samples for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m], minlength=VOCAB_SIZE
    )
    vocab, stats = build_draft_vocab(counts, 64)
    save_vocab(vocab, stats, counts, root / "vocab")
    return TrainConfig(features=str(features), vocab=str(root / "vocab"), model=str(model), out=str(root / "run"),
                       ttt_steps=3, max_batch_tokens=128, lr=3e-3, warmup_steps=3, progress=False,
                       checkpoint_every_steps=1000)  # fmt: skip


def _sharpen_lm_head(model_dir: Path, factor: float) -> None:
    """Scale the random verifier's lm_head so its next-token distribution is peaked (at init std 0.02 it is
    near uniform: the soft-label loss would start at its floor and have nothing to learn)."""
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, str(path), metadata={"format": "pt"})


def _first_step_loss(cfg: TrainConfig) -> tuple[float, Trainer]:
    trainer = Trainer(cfg)
    return float(trainer.train_step()["loss"]), trainer


def test_cuda_first_step_matches_cpu(base_cfg: TrainConfig) -> None:
    cpu_loss, cpu = _first_step_loss(dataclasses.replace(base_cfg, device="cpu"))
    assert cpu.device.type == "cpu" and not cpu.autocast
    fp32_loss, gpu = _first_step_loss(dataclasses.replace(base_cfg, device="cuda", autocast_bf16_cuda=False))
    assert gpu.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    assert gpu.model.t2d.device.type == "cuda" and gpu.teacher.lm_head_weight.device.type == "cuda"
    bf16_loss, bf16 = _first_step_loss(dataclasses.replace(base_cfg, device="cuda"))
    assert bf16.autocast  # bf16 autocast is the CUDA default
    print(json.dumps({"first_step_loss": {"cpu_fp32": cpu_loss, "cuda_fp32": fp32_loss, "cuda_bf16": bf16_loss}}))
    assert fp32_loss == pytest.approx(cpu_loss, rel=1e-3)
    assert bf16_loss == pytest.approx(cpu_loss, rel=5e-2)


def test_cuda_run_loss_decreases_and_checkpoint_loads_on_cpu(base_cfg: TrainConfig, tmp_path: Path) -> None:
    cfg = dataclasses.replace(base_cfg, device="auto", out=str(tmp_path / "run"), epochs=20, max_steps=60)
    result = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    n_tokens = sum(r["tokens"] for r in records if "tokens" in r)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "steps": result.steps, "first_loss": losses[0],
                      "last_loss": losses[-1], "tokens_per_s": n_tokens / result.train_s,
                      "heldout_sim_accept": result.heldout.get("heldout_sim_accept")}))  # fmt: skip
    assert result.steps == 60 and not result.stopped_early
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    # the checkpoint is CPU-side: a CPU trainer resumes it (CUDA RNG state is kept but not needed there)
    resumed = Trainer(dataclasses.replace(cfg, device="cpu", max_steps=61))
    assert resumed.resume() and resumed.step == 60
    assert all(p.device.type == "cpu" for p in resumed.model.parameters())
    resumed.train_step()
