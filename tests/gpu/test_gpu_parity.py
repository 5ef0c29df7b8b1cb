"""The vllm backend on CUDA (tensor parallel as available) equals plain transformers on the same GPU.

Per layer and sample, relative L2 against ``AutoModelForCausalLM`` with ``output_hidden_states=True``
(aux id k = ``hidden_states[k]``) and a hook on the last decoder layer (final = before the norm,
docs/architecture.md, "Layer ids"): < 1e-4 in fp32, < 5e-2 in bf16; samples of different lengths, each alone and all in
one ``extract`` call (one longer than the token budget: chunked prefill), and two clients at once
through a live ``eagle3 serve --backend vllm --device cuda``. Models: the embedded SmolLM2 (9 heads:
TP 1 only) and a random tiny Llama with 8 heads (TP up to 8).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.conftest import report, require_cuda, tp_size_for
from tests.integration.test_vllm_backend import extract_alone_and_packed, rel_l2

pytestmark = pytest.mark.gpu
MAX_BATCH_TOKENS = 256
BOUNDS = {"float32": 1e-4, "bfloat16": 5e-2}
LENGTHS = (13, 5, 700, 1, 90)  # 700 > MAX_BATCH_TOKENS


def reference(model: Any, aux: tuple[int, ...], ids: list[int]) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device="cuda"), output_hidden_states=True)
    hook.remove()
    taps = [out.hidden_states[k][0] for k in aux] + [captured[0][0]]  # each [T, H]
    return torch.stack(taps, dim=1).cpu()  # [T, L+1, H]


def model_dir(which: str, tiny_llama_gpu_dir: Path) -> Path:
    from eagle3.core.models import DEFAULT_MODEL, resolve_model_dir

    return tiny_llama_gpu_dir if which == "tiny" else resolve_model_dir(DEFAULT_MODEL)


def heads(path: Path) -> tuple[int, int]:
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_vllm_cuda_matches_transformers(which: str, dtype: str, tiny_llama_gpu_dir: Path) -> None:
    require_cuda()
    from transformers import AutoModelForCausalLM

    from eagle3.server.backends import BackendConfig
    from eagle3.server.backends.base import VllmOptions

    path = model_dir(which, tiny_llama_gpu_dir)
    tp = tp_size_for(*heads(path))
    config = BackendConfig(model=str(path), dtype=dtype, device="cuda", max_batch_tokens=MAX_BATCH_TOKENS,
                           tensor_parallel_size=tp, vllm=VllmOptions(gpu_memory_utilization=0.5))  # fmt: skip
    info, seqs, alone, packed = extract_alone_and_packed(config, LENGTHS, seed=1)
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model = model.to("cuda").eval()
    worst = 0.0
    for seq, single, batched in zip(seqs, alone, packed, strict=True):
        ref = reference(model, info.aux_layer_ids, seq)
        for got, how in ((single, "alone"), (batched, "packed")):
            errors = rel_l2(got, ref)
            worst = max(worst, float(errors.max()))
            report({"check": "parity", "model": which, "dtype": dtype, "tp": tp, "how": how, "n_tokens": len(seq),
                    "rel_l2_per_layer": [round(float(e), 8) for e in errors]})  # fmt: skip
            assert bool((errors < BOUNDS[dtype]).all()), f"{which} {dtype} tp={tp} {how} {len(seq)} tokens: {errors}"
    report({"check": "parity_summary", "model": which, "dtype": dtype, "tp": tp, "worst_rel_l2": worst})


def test_two_clients_at_once_through_the_server(tiny_llama_gpu_dir: Path, tmp_path: Path) -> None:
    """Concurrent requests over HTTP: each client's bf16 features equal transformers (bf16 bound)."""
    require_cuda()
    from transformers import AutoModelForCausalLM

    from eagle3.client.sdk import ExtractionClient
    from tests.e2e.live_server import LiveServer

    path = tiny_llama_gpu_dir
    tp = tp_size_for(*heads(path))
    args = ["--model", str(path), "--backend", "vllm", "--device", "cuda", "--tensor-parallel-size", str(tp),
            "--max-batch-tokens", str(MAX_BATCH_TOKENS)]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    batches = [[torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
               for lengths in ((40, 300, 7), (120, 2, 64, 500))]  # fmt: skip
    results: list[list[Any]] = [[], []]
    with LiveServer(args, tmp_path / "server.log") as server:
        server.wait_ready(timeout_s=1200)
        client = ExtractionClient(server.url)
        info = client.info()

        def pull(i: int) -> None:
            results[i] = list(client.extract(batches[i]))

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    for seqs, got in zip(batches, results, strict=True):
        assert len(got) == len(seqs)
        for seq, sample in zip(seqs, got, strict=True):
            assert sample.input_ids.tolist() == seq
            bits = np.ascontiguousarray(sample.hidden_states_bf16)  # uint16 bf16 bits [T, L, H]
            states = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            errors = rel_l2(states, reference(model, tuple(info.aux_layer_ids), seq))
            report({"check": "server_concurrent", "tp": tp, "n_tokens": len(seq),
                    "rel_l2_per_layer": [round(float(e), 6) for e in errors]})  # fmt: skip
            assert bool((errors < BOUNDS["bfloat16"]).all()), f"{len(seq)} tokens: {errors}"
