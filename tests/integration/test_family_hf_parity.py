"""The hf backend on the target family (tiny random-weight DeepSeek-V3 / Kimi-K2-style and Qwen3-MoE,
tests/family_models.py) equals transformers at every layer id, N included: fp32 bitwise (alone and
packed), bf16 within 3x transformers' own bf16 error against fp32 (capped at 5e-2). The vLLM side of
the same comparison: tests/integration/test_vllm_family.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.server.backends import BackendConfig, make_backend
from tests.family_models import deepseek_v3_dir, kimi_k25_dir, qwen3_moe_dir
from tests.integration.test_vllm_backend import rel_l2
from tests.integration.test_vllm_family import reference, sequences

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family")
    return {"deepseek": deepseek_v3_dir(root / "deepseek"), "qwen3moe": qwen3_moe_dir(root / "qwen3moe")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["deepseek", "qwen3moe"])
def test_hf_backend_equals_transformers_at_every_layer_id(
    family: str, dtype: str, family_dirs: dict[str, Path]
) -> None:
    model_dir = family_dirs[family]
    n_layers = 6 if family == "deepseek" else 4
    config = BackendConfig(model=str(model_dir), dtype=dtype, device="cpu", aux_layer_ids=tuple(range(n_layers)))
    backend: Any = make_backend("hf", config)
    backend.load(lambda _p, _f: None)
    layer_ids = (*range(n_layers), n_layers)
    assert (*backend.info.aux_layer_ids, backend.info.num_hidden_layers) == layer_ids
    seqs = sequences(backend.info.vocab_size)
    alone = [backend.extract([s])[0] for s in seqs]
    packed = backend.extract(seqs)
    torch_dtype = getattr(torch, dtype)
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        want = reference(model_dir, torch_dtype, seq, layer_ids)
        if dtype == "float32":
            assert torch.equal(single, want) and torch.equal(batched, want), f"{family} {len(seq)} tokens"
            continue
        assert torch.equal(single.float(), want), f"{family} bf16 alone, {len(seq)} tokens"  # same kernels
        fp32 = reference(model_dir, torch.float32, seq, layer_ids)
        bound = (3.0 * rel_l2(want, fp32)).clamp(min=1e-2, max=5e-2)
        errors = rel_l2(batched.float(), fp32)  # padded groups: other kernel blocking, bf16 rounding
        assert bool((errors <= bound).all()), f"{family} bf16 packed, {len(seq)} tokens: {errors.tolist()} > {bound}"


def test_hf_backend_extracts_a_kimi_k25_wrapper(tmp_path: Path) -> None:
    """Kimi-K2.5 is a ``kimi_k25`` checkpoint that transformers maps only as image-text-to-text: the hf
    backend loads it as that and taps its language model (before: ``Unrecognized configuration class ...
    for AutoModelForCausalLM`` at load). fp32 states equal the wrapper's own language model, bitwise."""
    from transformers import AutoModelForImageTextToText

    model_dir = kimi_k25_dir(tmp_path / "kimi-k25")
    config = BackendConfig(model=str(model_dir), dtype="float32", device="cpu", aux_layer_ids=tuple(range(6)))
    backend: Any = make_backend("hf", config)
    backend.load(lambda _p, _f: None)
    info = backend.info
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (6, 256, 512)
    wrapper: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    language_model = wrapper.model.language_model
    captured: list[torch.Tensor] = []
    language_model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    for seq in sequences(info.vocab_size)[:3]:
        captured.clear()
        with torch.inference_mode():
            out = language_model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        want = torch.stack([*(out.hidden_states[k][0] for k in range(6)), captured[0][0]], dim=1)
        assert torch.equal(backend.extract([seq])[0], want), f"{len(seq)} tokens"
    # generation runs the whole wrapper (its lm_head): greedy, as transformers' own generate on it
    from eagle3.core.protocol.generate import Sampling

    prompt = sequences(info.vocab_size)[0]
    (got,) = backend.generate([prompt], Sampling(max_new_tokens=6, stop_token_ids=()))
    with torch.inference_mode():
        ref = wrapper.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert got.output_ids == ref[0, len(prompt) :].tolist() and len(got.output_ids) == 6
