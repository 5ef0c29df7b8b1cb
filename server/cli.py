"""``eagle3 serve``: parse flags into ``ServerSettings`` and run uvicorn with our own drain on SIGTERM.

The port is bound at once (probes answer while the model loads in the background); the line
``eagle3 serve: listening on http://HOST:PORT`` goes to stderr as soon as it is. SIGTERM or SIGINT:
``/readyz`` turns 503 draining, new extracts get 503, open streams finish for up to
``--drain-timeout-s`` (then get an ERROR frame), and the process exits 0. A second signal forces exit.
A configuration error (a bad flag, variable or ``--config`` entry, a ``--model`` that names nothing,
an unknown ``--engine-arg`` or a setting the backend cannot load with) exits with status 2, as ``vllm
serve`` does, whether found before the port is bound or while loading; a load failure that a restart
may cure (out of memory, a failed download) keeps the process up, ``failed`` on /readyz.
Heavy imports (uvicorn, fastapi, torch) happen only when the command runs. The flags are generated
from ``ServerSettings`` (server/config.py), each with its ``EAGLE3_*`` variable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from eagle3.core.config_files import ConfigFileError, merge, parse_set_items
from eagle3.core.engine_args import EngineArgsError
from eagle3.core.knobs import KnobError, add_knob_arguments, load_config_file, resolve
from eagle3.core.models import ModelNotFoundError, is_embedded_name, resolve_model_dir
from eagle3.server.backends.dummy_model import dummy_shape, is_dummy
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
        "its EAGLE3_* environment variable and the --config file; a flag given here wins over all of them, "
        "then --set, then the variable, then the file.",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML, JSON or TOML file of settings by extension (keys: flag names; engine_args: a "
        "mapping of vLLM EngineArgs fields)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one setting as a --config key, repeatable; dotted keys reach into mappings: "
        "--set engine_args.max_num_seqs=8",
    )
    add_knob_arguments(p, ServerSettings)
    p.add_argument("--cache-dir", dest="renamed_cache_dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=run_serve)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerSettings:
    """Flags, then ``--set`` overrides, then ``EAGLE3_*`` variables, then ``--config``, then the defaults.
    ``--model`` (or ``EAGLE3_MODEL``, or the key ``model``) is required unless ``--backend synthetic``.
    The settings' ``sources`` say where each value not left at its default came from."""
    config_file = getattr(args, "config", None) or (environ or os.environ).get("EAGLE3_CONFIG")
    sources: dict[str, str] = {}
    if "renamed_cache_dir" in vars(args):
        raise SettingsError(RENAMED_CACHE_DIR)
    try:
        file_config = load_config_file(config_file) if config_file else {}
        overrides = parse_set_items(getattr(args, "set", None) or [])
        if isinstance(overrides.get("engine_args"), dict) and isinstance(file_config.get("engine_args"), dict):
            overrides["engine_args"] = merge(file_config["engine_args"], overrides["engine_args"])  # key by key
        config = _engine_args_as_items(file_config, "--config")
        overrides = _engine_args_as_items(overrides, "--set")
        values = resolve(ServerSettings, args, environ, config, sources)
        given = vars(args)
        set_sources: dict[str, str] = {}
        for name, value in resolve(ServerSettings, argparse.Namespace(), {}, overrides, set_sources).items():
            if name not in given:  # a flag wins over --set; --set wins over the variable and the file
                values[name], sources[name] = value, set_sources[name].replace("--config", "--set", 1)
    except (KnobError, ConfigFileError) as exc:
        raise SettingsError(str(exc)) from None
    values["sources"] = sources
    keys_text = (os.environ if environ is None else environ).get(KEYS_ENV)
    if keys_text:
        values["api_keys_text"] = keys_text
    if values.get("tensor_parallel_size") is None:  # counting GPUs imports torch: only when vllm may run
        backend = values.get("backend", "auto")
        values["tensor_parallel_size"] = 1 if backend == "hf" else default_tensor_parallel_size()
    settings = ServerSettings(**values)
    settings.check_model()  # a usage error (status 2) naming what to pass
    if settings.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise SettingsError("--backend vllm needs vLLM in this environment: pip install 'eagle3[vllm]' (CUDA)")
    return settings


RENAMED_CACHE_DIR = (
    "--cache-dir is now --feature-cache-dir ($EAGLE3_FEATURE_CACHE_DIR): the feature cache's disk tier; "
    "$EAGLE3_CACHE_DIR means only the model cache's root and no longer turns the feature cache on"
)


def _engine_args_as_items(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A mapping under the key ``engine_args`` (``engine_args: {max_num_seqs: 8}`` in a file, or ``--set
    engine_args.max_num_seqs=8``) becomes ``engine_arg`` items ``KEY=VALUE`` (VALUE as JSON), after any
    ``engine_arg`` list already there; the pass-through check of the vllm backend then names a typo."""
    mapping = config.pop("engine_args", None)
    if mapping is None:
        return config
    if not isinstance(mapping, dict):
        raise SettingsError(f"{where} engine_args: expected a mapping of vLLM EngineArgs fields, got {mapping!r}")
    listed = config.get("engine_arg") or []
    items = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in mapping.items()]
    config["engine_arg"] = [*(listed if isinstance(listed, list) else [listed]), *items]
    return config


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
    try:
        settings = settings_from_args(args)
        if settings.model is not None and is_dummy(settings.model):
            dummy_shape(settings.model)  # fail fast on an unknown shape
        elif settings.model is not None and not is_embedded_name(settings.model):
            resolve_model_dir(settings.model)  # fail fast on a bad --model (the embedded one converts later)
    except (KnobError, EngineArgsError, ModelNotFoundError) as exc:  # the same settings can only fail again
        print(f"eagle3 serve: error: {exc}", file=sys.stderr)
        return 2
    from eagle3.server.serve import serve

    return serve(settings)
