"""The backend contract: what the scheduler needs from an engine, and nothing more.

A backend owns the verifier. The server constructs it from ``BackendConfig``, calls ``load`` once in
a background thread (reporting progress for ``/readyz``), then calls ``extract`` from one worker
thread with batches the scheduler packed under the token budget. ``extract`` never sees padding, HTTP
or tenants; the scheduler never sees torch modules.

Invariants every backend keeps (tests/integration/test_backend_parity.py holds each one):

* Layer semantics are vLLM's (docs/architecture.md, "Layer ids"). For ``aux_layer_ids = (a, b, c)`` and ``N`` decoder
  layers, ``extract`` returns per sample a tensor ``[n_tokens, len(aux) + 1, hidden]`` whose slot j
  is the residual stream entering decoder layer ``aux[j]`` (HF ``hidden_states[aux[j]]``) and whose
  last slot is the output of decoder layer ``N - 1`` before the final norm.
* Batched equals single: a sample's states do not depend on what it was batched with.
* Returned tensors are on CPU, contiguous, in ``BackendInfo.dtype``; one per input, in input order.
* ``extract`` raises ``BackendError`` for an engine failure; input validation (ids in range, length
  within context) happens before the scheduler, so a backend may assume valid input.

``generate`` and ``start_generation`` (``POST /v1/generate``, a request run in slices where the engine
allows; tests/integration/test_generate.py and tests/integration/test_vllm_generate.py hold these):

* Greedy (``temperature == 0``) is the engine's own greedy decoding: hf equals transformers
  ``model.generate(do_sample=False)`` token for token, vllm equals vLLM's ``LLM.generate`` with
  ``temperature=0`` on an engine without the extraction hooks.
* A reply depends only on its own request (its prompts, their order and the sampling settings), never
  on what else the server runs: a request is one unit of work, and a seeded sampled request gives the
  same tokens every time on the same server.
* Each reply stops right after the first token of ``stop_token_ids`` (kept, ``finish_reason
  "stop"``) or after ``max_new_tokens`` tokens (``"length"``); prompt + ``max_new_tokens`` fits the
  context (the route checks it before admission).
* A backend that cannot generate has ``can_generate = False`` or no such attribute (the route answers
  400 before any work); a ``generate`` it has raises a non-retryable ``BackendError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from eagle3.core.errors import Eagle3Error
from eagle3.core.protocol.model_identity import ModelIdentity

if TYPE_CHECKING:
    import torch

    from eagle3.core.protocol.generate import Sampling

ProgressCallback = Callable[[str, float], None]  # (phase, fraction in [0, 1])


class BackendError(Eagle3Error, RuntimeError):
    """The engine failed on a batch. ``retryable=False`` when the engine rejected the input itself
    (the same sample can only fail again: a SAMPLE_ERROR ``invalid_sample``); True for faults of the
    engine (``backend_error``; core/protocol/error_types.py)."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class BackendConfigError(BackendError):
    """A setting the backend cannot load with (an unknown ``--engine-arg``, ``--aux-layer-ids`` out of
    range, ``--max-model-len`` over the model's, a ``--device`` this build lacks): every restart with the
    same settings fails the same way, so ``eagle3 serve`` exits with status 2 instead of staying up as
    failed (server/load_checks.py ``retry_could_cure``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


@dataclass(frozen=True)
class VllmOptions:
    """The vllm backend's own settings (docs/vllm.md). ``engine_args`` passes any further field of
    vLLM's ``EngineArgs`` through; unknown names and the ones this backend owns are refused at load."""

    kv_cache_gib: float | None = None  # KV cache size (CPU default 2 GiB; CUDA: gpu_memory_utilization)
    gpu_memory_utilization: float | None = None  # CUDA only (vLLM's default 0.9)
    compile: bool = False  # torch.compile + CUDA graphs instead of eager mode
    hidden_states_dir: str | None = None  # parent of the handover directory (default /dev/shm)
    engine_args: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class SyntheticOptions:
    """The synthetic backend's shape (benchmarks and tests only; server/backends/synthetic.py)."""

    hidden_size: int = 4096
    num_hidden_layers: int = 32
    seed: int = 0
    tokens_per_s: float | None = None  # a simulated forward pass: extract() takes n_tokens / tokens_per_s

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise BackendError(f"synthetic backend: {name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class BackendConfig:
    model: str  # a local HF directory or the embedded default's name (eagle3.core.models.resolve_model_dir)
    aux_layer_ids: tuple[int, ...] | None = None  # None: (2, N // 2, N - 3)
    dtype: str = "bfloat16"  # "bfloat16" | "float32"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_batch_tokens: int = 8192  # the most tokens one extract() call receives
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    tensor_parallel_size: int = 1  # vllm only
    trust_remote_code: bool = False  # run the checkpoint's own modelling code
    vllm: VllmOptions = field(default_factory=VllmOptions)
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)


@dataclass(frozen=True)
class BackendInfo:
    model_id: str
    revision: str  # sha256 over config.json and the weight files' names, sizes and content digests
    model_dir: str
    num_hidden_layers: int  # N
    hidden_size: int
    vocab_size: int  # embedding rows: valid ids are [0, vocab_size)
    max_model_len: int
    dtype: str
    aux_layer_ids: tuple[int, ...]
    tokenizer_sha256: str
    backend: str  # "hf" | "vllm"
    device: str

    @property
    def final_layer_id(self) -> int:
        return self.num_hidden_layers

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity.of(self)

    @property
    def n_layers_out(self) -> int:
        return len(self.aux_layer_ids) + 1


@dataclass(frozen=True)
class Generation:
    """One prompt's reply: the generated ids only (a stop token that ended it is the last one)."""

    output_ids: list[int]
    finish_reason: str  # "stop" | "length"


def cut_at_stop(ids: Sequence[int], stop_token_ids: Sequence[int], max_new_tokens: int) -> Generation:
    """``ids`` up to and including the first stop token, at most ``max_new_tokens`` of them."""
    stops = set(stop_token_ids)
    out: list[int] = []
    for token in list(ids)[:max_new_tokens]:
        out.append(int(token))
        if token in stops:
            return Generation(out, "stop")
    return Generation(out, "length")


class Backend(Protocol):
    name: str

    def load(self, progress: ProgressCallback) -> BackendInfo:
        """Load the verifier and warm it up; called once, off the event loop."""
        ...

    def extract(self, batch: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Hidden states per sample: ``[n_tokens, len(aux) + 1, hidden]`` each, CPU, ``info.dtype``."""
        ...

    def close(self) -> None:
        """Release the engine (processes, memory). Idempotent."""
        ...


class GenerationRun(Protocol):
    """One generate request in progress (``GeneratingBackend.start_generation``). The scheduler runs it
    one slice per turn, so other work interleaves and a client that leaves stops it within a slice."""

    def advance(self, max_new_tokens: int) -> list[Generation] | None:
        """Generate up to ``max_new_tokens`` more tokens per prompt: every reply when the request is
        done (each prompt stopped or at ``sampling.max_new_tokens``), else None."""
        ...

    @property
    def generated_tokens(self) -> int:
        """New tokens produced so far, over every prompt (replies cut at their stop token)."""
        ...


class WholeGeneration:
    """A ``GenerationRun`` for an engine that generates a request in one call (one slice: all of it)."""

    def __init__(self, generate: Callable[[], list[Generation]]) -> None:
        self._generate = generate
        self.generated_tokens = 0

    def advance(self, max_new_tokens: int) -> list[Generation] | None:  # noqa: ARG002 (one slice: all of it)
        replies = self._generate()
        self.generated_tokens = sum(len(g.output_ids) for g in replies)
        return replies


@runtime_checkable
class GeneratingBackend(Backend, Protocol):
    """A backend that also serves ``POST /v1/generate`` (hf, vllm; synthetic says it cannot). Optional:
    the server treats a backend that is no ``GeneratingBackend`` (a test double, a third-party engine)
    as one that cannot generate, so ``Backend`` itself does not require it."""

    can_generate: bool

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:
        """One reply per prompt, in order (see the module invariants); ``sampling.stop_token_ids`` is
        resolved (never None) by the caller."""
        ...

    def start_generation(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> GenerationRun:
        """The same replies as ``generate``, produced a slice at a time (``GenerationRun.advance``);
        ``WholeGeneration`` where the engine cannot stop and resume."""
        ...

    def check_sampling(self, sampling: Sampling) -> None:
        """The engine's own validation of the sampling settings, before admission: a non-retryable
        ``BackendError`` naming the limit (the route's 400) for what the engine would refuse."""
        ...
