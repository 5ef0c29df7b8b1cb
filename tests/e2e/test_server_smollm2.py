"""The real verifier behind a live server: features over the wire equal plain transformers (bf16
bits), chat messages are tokenized and masked exactly like the SDK's ``prepare`` would, and the
tokenizer hash in HEADER and /v1/info equals ``eagle3.client.prepare.tokenizer_sha256``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from eagle3.core.conversations import Message
from eagle3.core.identity import tokenizer_sha256
from eagle3.core.masking import ChatTokenizer
from eagle3.core.protocol.frames import FrameType
from tests.e2e.live_server import LiveServer, assemble, iter_frames

pytestmark = pytest.mark.e2e
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]


def reference(model_dir: Path, ids: list[int], aux: list[int]) -> np.ndarray[Any, Any]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    final: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: final.append(out))
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    states = torch.stack([out.hidden_states[k][0] for k in aux] + [final[0][0]], dim=1)  # [T, L+1, H]
    bits: np.ndarray[Any, Any] = states.view(torch.int16).numpy().view(np.uint16)
    return bits


def test_smollm2_features_over_the_wire(tmp_path: Path, smollm2_dir: Path, smollm2_tokenizer: Any) -> None:
    args = ["--model", str(smollm2_dir), "--max-batch-tokens", "64", "--max-payload-mb", "0.05"]
    with LiveServer(args, tmp_path / "server.log") as server:
        server.wait_ready(timeout_s=300)
        info = httpx.get(f"{server.url}/v1/info").json()
        assert info["tokenizer_sha256"] == tokenizer_sha256(smollm2_dir)
        assert (info["num_hidden_layers"], info["hidden_size"], info["aux_layer_ids"]) == (30, 576, [2, 15, 27])
        ids = [int(t) for t in np.random.default_rng(5).integers(0, info["vocab_size"], 24)]
        body = {"samples": [{"id": "ids", "input_ids": ids}, {"id": "chat", "messages": CHAT}]}
        with httpx.stream("POST", f"{server.url}/v1/extract", json=body, timeout=120) as resp:
            frames = list(iter_frames(resp))
        assert frames[0].meta["tokenizer_sha256"] == info["tokenizer_sha256"] and frames[-1].type == FrameType.END
        samples = assemble(frames)
        expected = ChatTokenizer(smollm2_tokenizer).tokenize([Message(**m) for m in CHAT])
        assert samples["chat"]["input_ids"].tolist() == expected.input_ids
        assert samples["chat"]["loss_mask"].tolist() == expected.loss_mask
        for name, sample_ids in (("ids", ids), ("chat", expected.input_ids)):
            got = samples[name]["hidden_states"]
            assert np.array_equal(got, reference(smollm2_dir, sample_ids, info["aux_layer_ids"])), name
        rss_mb = server.rss_bytes() / 2**20
        assert 100 < rss_mb < 4096, rss_mb
