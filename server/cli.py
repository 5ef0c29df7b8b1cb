"""``eagle3 serve``: parse flags into ``ServerSettings`` and run uvicorn with our own drain on SIGTERM.

The port is bound at once (probes answer while the model loads in the background); the line
``eagle3 serve: listening on http://HOST:PORT`` goes to stderr as soon as it is. SIGTERM or SIGINT:
``/readyz`` turns 503 draining, new extracts get 503, open streams finish for up to
``--drain-timeout-s`` (then get an ERROR frame), and the process exits 0. A second signal forces exit.
Heavy imports (uvicorn, fastapi, torch) happen only when the command runs. The flags are generated
from ``ServerSettings`` (server/config.py), each with its ``EAGLE3_*`` variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from eagle3.core.knobs import KnobError, add_knob_arguments, load_config_file, resolve
from eagle3.core.models import is_embedded_name, resolve_model_dir
from eagle3.server.backends.dummy_model import is_dummy
from eagle3.server.config import (
    KEYS_ENV,
    ServerSettings,
    SettingsError,
    default_tensor_parallel_size,
)


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the resident hidden-state extraction server",
        description="Load the verifier once and serve /v1/extract to every user. Every flag also reads "
        "its EAGLE3_* environment variable and the --config file; a flag given here wins over both.",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="YAML or JSON file of settings (keys: flag names)")
    add_knob_arguments(p, ServerSettings)
    p.set_defaults(func=run_serve)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerSettings:
    """Flags, then ``EAGLE3_*`` variables, then ``--config``, then the defaults. ``--model`` (or
    ``EAGLE3_MODEL``, or the key ``model``) is required unless ``--backend synthetic``."""
    config_file = getattr(args, "config", None) or (environ or os.environ).get("EAGLE3_CONFIG")
    try:
        config = load_config_file(config_file) if config_file else None
        values = resolve(ServerSettings, args, environ, config)
    except KnobError as exc:
        raise SettingsError(str(exc)) from None
    keys_text = (os.environ if environ is None else environ).get(KEYS_ENV)
    if keys_text:
        values["api_keys_text"] = keys_text
    if values.get("tensor_parallel_size") is None:  # counting GPUs imports torch: only when vllm may run
        backend = values.get("backend", "auto")
        values["tensor_parallel_size"] = 1 if backend == "hf" else default_tensor_parallel_size()
    settings = ServerSettings(**values)
    settings.check_model()  # a usage error (status 2) naming what to pass
    return settings


# Kernel caches keyed by tensor shape: PyTorch's ideep LRU and oneDNN's primitive cache, 1,024 entries each
# by default. Packed batches bring new shapes all the time, so at the defaults the server's RSS grows with
# every distinct batch shape seen (measured: +330 MB over 160k tokens of chat samples); 16 entries keep it
# flat at no measurable cost in tokens/s (docs/performance.md, "Extraction"). Both are read at the first
# forward pass, so setting them here (before the backend loads; vLLM's workers inherit them) is in time.
KERNEL_CACHE_ENV = {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
# Transparent huge pages for PyTorch's CPU tensors of 2 MiB and more. Where the kernel gives huge pages only
# on request (THP "madvise", the common default), every fresh host tensor of states is otherwise faulted in
# 4 KiB at a time: 150,000 page faults per 655 MB of states with the synthetic backend, against ~10,000
# with it, and the server's CPU per GB -20 % (docs/performance.md, "Serving path"). PyTorch reads the
# variable once, at its first allocation, so it must be set before torch is imported: here is in time.
HUGE_PAGES_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}
SERVER_PROCESS_ENV = {**KERNEL_CACHE_ENV, **HUGE_PAGES_ENV}


def run_serve(args: argparse.Namespace) -> int:
    for name, value in SERVER_PROCESS_ENV.items():
        os.environ.setdefault(name, value)  # the operator's own setting wins
    settings = settings_from_args(args)
    if settings.model is not None and not is_embedded_name(settings.model) and not is_dummy(settings.model):
        resolve_model_dir(settings.model)  # fail fast on a bad --model (the embedded one converts in the background)
    from eagle3.server.serve import serve

    serve(settings)
    return 0
