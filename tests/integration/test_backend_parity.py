"""The hf backend's features equal plain transformers for the same tokens, alone and packed.

Reference: ``AutoModelForCausalLM`` with ``output_hidden_states=True`` (aux id k = ``hidden_states[k]``)
and a forward hook on the last decoder layer (the final state before the norm). fp32 must be bitwise
equal, alone and packed; bf16 alone within bf16 rounding of transformers' bf16, packed within 3x the bf16
noise transformers itself shows against its fp32 forward on the same machine. "Packed" goes through the
scheduler's batch path: one ``extract`` call with samples of different lengths (in bf16 the backend pads
groups of similar lengths into one forward call, so packed states may differ from lone ones by bf16
rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.server.backends import BackendConfig, make_backend
from eagle3.server.backends.hf import HfBackend
from tests.e2e.live_server import tiny_llama_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


def reference_states(model_dir: Path, dtype: torch.dtype, aux: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    captured: list[torch.Tensor] = []
    last = model.model.layers[-1]
    hook = last.register_forward_hook(lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    taps = [out.hidden_states[k][0] for k in aux] + [captured[0][0]]  # each [T, H]
    return torch.stack(taps, dim=1)  # [T, L+1, H]


def sequences(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (13, 5, 21, 1, 12, 20, 19, 4)]


def load(model_dir: Path, dtype: str) -> HfBackend:
    backend = make_backend("hf", BackendConfig(model=str(model_dir), dtype=dtype, device="cpu"))
    assert isinstance(backend, HfBackend)
    backend.load(lambda _phase, _fraction: None)
    return backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_hf_backend_matches_transformers(which: str, dtype: str, tiny_dir: Path, smollm2_dir: Path) -> None:
    model_dir = tiny_dir if which == "tiny" else smollm2_dir
    backend = load(model_dir, dtype)
    info = backend.info
    assert info is not None and info.final_layer_id == info.num_hidden_layers
    n = info.num_hidden_layers
    assert info.aux_layer_ids == (2, n // 2, n - 3)
    seqs = sequences(info.vocab_size)
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    alone = [backend.extract([s])[0] for s in seqs]
    packed = backend.extract(seqs)  # one call, different lengths: the scheduler's batch path
    n_slots = len(info.aux_layer_ids) + 1
    bf16_noise = [0.0] * n_slots  # per layer slot: the worst relative L2 of transformers' bf16 against its fp32
    packed_err = [0.0] * n_slots  # per layer slot: the worst relative L2 of the packed states against fp32
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        ref = reference_states(model_dir, torch_dtype, info.aux_layer_ids, seq)
        assert single.shape == (len(seq), n_slots, info.hidden_size)
        assert single.dtype == torch_dtype and batched.dtype == torch_dtype
        if dtype == "float32":
            assert torch.equal(single, batched), "batched differs from single"
            assert torch.equal(single, ref)
        else:
            torch.testing.assert_close(single.float(), ref.float(), rtol=2**-7, atol=1e-5)
            exact = reference_states(model_dir, torch.float32, info.aux_layer_ids, seq)
            for layer in range(n_slots):
                bf16_noise[layer] = max(bf16_noise[layer], relative_l2(ref[:, layer], exact[:, layer]))
                packed_err[layer] = max(packed_err[layer], relative_l2(batched[:, layer], exact[:, layer]))
    if dtype == "bfloat16":
        # A padded forward runs other kernels (other tile shapes, so other bf16 rounding) than a lone one, and
        # the rounding compounds over the layers: the packed states are held to the size of bf16 noise itself,
        # measured on this machine as transformers' own bf16 against its fp32 (AMX CPUs round differently from
        # AVX2 ones; a fixed bound was machine-dependent). A padding bug (attending to pads, wrong rows) is
        # an O(1) error, far above it.
        for layer in range(n_slots):
            bound = 3 * bf16_noise[layer] + 1e-3
            assert packed_err[layer] <= bound, (
                f"packed layer slot {layer}: relative L2 {packed_err[layer]:.2e} vs fp32 transformers, over "
                f"3x the bf16 noise of transformers itself ({bf16_noise[layer]:.2e})"
            )
    if dtype == "bfloat16":  # the padded path really ran: some forward call held several samples
        assert max(len(group) for group in backend._groups(seqs)) > 1
    # the final state is pre-norm: it must differ from HF's normed hidden_states[N]
    assert not torch.allclose(alone[0][:, -1], reference_final_normed(model_dir, torch_dtype, seqs[0]))
    backend.close()


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def reference_final_normed(model_dir: Path, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model: Any = AutoModel.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    final: torch.Tensor = out.hidden_states[-1][0]
    return final
