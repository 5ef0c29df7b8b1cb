"""The ``synthetic`` backend: deterministic bf16 states of a chosen shape at memory speed (benchmarks, tests).

It runs no model. It exists so that the serving path's own ceiling (scheduling, copies, framing,
codec, HTTP, client decode, disk) can be measured on any machine, at the byte rates of a big
verifier on a GPU (``--synthetic-hidden-size 4096`` with 4 taps = 32 KB of bf16 per token), and so
that end-to-end tests can check bitwise equality cheaply.

Never chosen by ``--backend auto``; ``/v1/info`` reports ``"backend": "synthetic"`` and
``"benchmark_only": true``. The tokenizer (chat template, vocab size, ``tokenizer_sha256``) is the one
of ``--model`` (the embedded SmolLM2 by default), so datasets prepared for that model are accepted.

Invariants:

* ``states(ids)[t]`` depends only on ``(ids[t], t)`` and the seed: row
  ``(ids[t] * ROW_MULT + t * POS_MULT) % POOL_ROWS`` of a pool of random bf16 rows (``N(0, 3)``, like
  real activations, so the codecs see realistic entropy). Batched equals single, bitwise.
* Returned tensors are CPU, contiguous bf16 ``[n, len(aux) + 1, hidden]`` (the base contract).
* The same seed and shape give the same pool on every host (``torch.Generator`` CPU stream).
* With ``tokens_per_s`` (``--synthetic-tokens-per-s``) an ``extract`` call lasts ``n_tokens / tokens_per_s``
  seconds (a verifier's forward pass of that speed: the scheduling benchmarks use it); the states
  are the same.
* No generation: there is no model to continue a prompt with. ``can_generate`` is False, so
  ``POST /v1/generate`` answers 400 naming the backend before any work, and ``generate`` raises a
  non-retryable ``BackendError`` (a toy continuation would let a pipeline train on text no verifier wrote).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

import torch

from eagle3.core.identity import tokenizer_sha256
from eagle3.core.layers import check_aux_layer_ids, default_aux_layer_ids
from eagle3.core.models import resolve_model_dir
from eagle3.core.protocol.generate import Sampling
from eagle3.server.backends.base import BackendConfig, BackendError, BackendInfo, Generation, ProgressCallback

POOL_ROWS = 1024  # distinct token rows; 1024 x 4 x 4096 x 2 B = 32 MiB at the 8B shape
ROW_MULT = 1_000_003
POS_MULT = 7_919
DEFAULT_HIDDEN_SIZE = 4096
DEFAULT_NUM_LAYERS = 32
DEFAULT_MAX_MODEL_LEN = 32768


def make_pool(n_layers_out: int, hidden_size: int, seed: int) -> torch.Tensor:
    """``[POOL_ROWS, n_layers_out, hidden_size]`` bf16 of N(0, 3), the same on every host for ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((POOL_ROWS, n_layers_out, hidden_size), generator=gen, dtype=torch.float32) * 3.0
    return pool.to(torch.bfloat16).contiguous()


def row_index(ids: Sequence[int]) -> torch.Tensor:
    """Pool row of every position of one sample (int64 ``[n]``)."""
    tokens = torch.as_tensor(list(ids), dtype=torch.int64)
    positions = torch.arange(tokens.numel(), dtype=torch.int64)
    return (tokens * ROW_MULT + positions * POS_MULT) % POOL_ROWS


class SyntheticBackend:
    name = "synthetic"
    can_generate = False

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.hidden_size = config.synthetic.hidden_size
        self.num_hidden_layers = config.synthetic.num_hidden_layers
        self.seed = config.synthetic.seed
        self.pool: torch.Tensor | None = None
        self.info: BackendInfo | None = None

    def load(self, progress: ProgressCallback) -> BackendInfo:
        from transformers import AutoConfig

        progress("resolving tokenizer", 0.0)
        model_dir = resolve_model_dir(self.config.model)
        vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
        n = self.num_hidden_layers
        aux = check_aux_layer_ids(self.config.aux_layer_ids or default_aux_layer_ids(n), n)
        if self.config.dtype != "bfloat16":
            raise BackendError(f"synthetic backend makes bfloat16 states only, not {self.config.dtype}")
        progress("building the state pool", 0.3)
        self.pool = make_pool(len(aux) + 1, self.hidden_size, self.seed)
        shape = {"hidden_size": self.hidden_size, "num_hidden_layers": n, "seed": self.seed, "pool": POOL_ROWS}
        self.info = BackendInfo(
            model_id=f"synthetic-h{self.hidden_size}-l{n}",
            revision=hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest(),
            model_dir=str(model_dir),
            num_hidden_layers=n,
            hidden_size=self.hidden_size,
            vocab_size=vocab_size,
            max_model_len=self.config.max_model_len or DEFAULT_MAX_MODEL_LEN,
            dtype="bfloat16",
            aux_layer_ids=aux,
            tokenizer_sha256=tokenizer_sha256(model_dir),
            backend=self.name,
            device="cpu",
        )
        progress("ready", 1.0)
        return self.info

    def states(self, ids: Sequence[int]) -> torch.Tensor:
        """bf16 ``[n, L, H]`` for one sample (see the module invariants)."""
        if self.pool is None:
            raise BackendError("backend not loaded")
        return self.pool.index_select(0, row_index(ids))

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        started = time.perf_counter()
        out = [self.states(ids) for ids in batch]
        rate = self.config.synthetic.tokens_per_s
        if rate:
            time.sleep(max(0.0, sum(len(ids) for ids in batch) / rate - (time.perf_counter() - started)))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:  # noqa: ARG002
        raise BackendError(
            "the synthetic backend runs no model and cannot generate; serve --backend hf or vllm", retryable=False
        )

    def close(self) -> None:
        self.pool = None


def describe_extra(backend_name: str) -> dict[str, object]:
    """Extra ``/v1/info`` fields: a synthetic server says it is one."""
    return {"benchmark_only": backend_name == "synthetic"}
