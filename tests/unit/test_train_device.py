"""Device resolution for the trainer (``TrainConfig.device``) and device-neutral checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.draft_trainer.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from eagle3.draft_trainer.config import TrainConfig, load_config, resolve_device
from eagle3.draft_trainer.errors import ConfigError


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_and_auto_without_cuda_resolve_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda(monkeypatch)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto", local_rank=3) == torch.device("cpu")
    assert TrainConfig().device == "auto"


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match=f"device '{spec}': CUDA is not available"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "mps", ""])
def test_bad_device_strings_are_rejected_naming_the_value(spec: str) -> None:
    with pytest.raises(ConfigError, match="device must be"):
        resolve_device(spec)
    with pytest.raises(ConfigError, match=repr(spec)):
        load_config(None, {"device": spec})


def test_cuda_index_and_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """With (pretended) 2 GPUs: auto/cuda take LOCAL_RANK's GPU, cuda:N that one, a missing index fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", local_rank=0) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="cuda:2 does not exist"):
        resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="cuda:5 does not exist"):
        resolve_device("auto", local_rank=5)


def test_checkpoint_holds_cpu_tensors_and_rng_round_trips(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(4.0)}, "nested": [torch.ones(2)], "rng": rng_state(torch.device("cpu"))}
    assert "cuda" not in state["rng"]  # a CPU run saves no CUDA state
    first = torch.rand(3)  # the draw right after the state was taken
    save_checkpoint(tmp_path, state)
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0)) and loaded["model"]["w"].device.type == "cpu"
    set_rng_state(loaded["rng"], torch.device("cpu"))
    assert torch.equal(torch.rand(3), first)
