"""vLLM's engine start as ``/readyz`` phases: what the engine core and its workers log, mapped to a phase
text and a progress figure that only rises.

vLLM's engine core and workers are other processes (V1 multiprocessing), so a handler in the server
process never sees their records. vLLM 0.32 applies its ``LoggingConfig`` (an ``EngineArgs`` field,
``logging_config``) in every process it starts (``EngineCoreProc.run_engine_core``,
``WorkerProc.worker_main``), and ``LoggingConfig.pylogging_config_file`` is a ``dictConfig`` JSON that
replaces vLLM's default. ``logging_config`` builds that JSON from vLLM's own default (the console handler
and its format are unchanged, so operators' logs look the same) plus a ``PhaseFileHandler`` that appends
the records this module knows (``is_phase_line``) to a file in a private directory of the backend.
``PhaseWatcher`` tails that file in the server during ``load`` and reports each new phase.

Why logs: the engine core's handshake with the front end carries only "hello" and "ready"; vLLM's
OpenTelemetry spans (``vllm.tracing.instrument``) end when the same steps log, and need the
opentelemetry SDK and a collector; the stats loggers start after the engine is up. The log lines are
the only source of the steps in between, in every vLLM process, without extra packages.

Invariants:

* A line no pattern knows is ignored; a known message that never comes (another device, another vLLM
  version) only means fewer phases. Progress stays where it was, and ``/readyz`` still has
  ``elapsed_s`` / ``expected_s`` (server/load_history.py).
* ``PhaseTracker`` reports an event only when its progress is above the last one reported, so
  progress never goes backwards and a message that repeats (every tensor-parallel rank, the drafter's
  own "Loading weights took") never rewinds the phase text.
* ``PhaseFileHandler`` writes only known lines, one ``write`` per record to an ``O_APPEND`` descriptor
  (lines from several processes never interleave), stops at ``MAX_LOG_BYTES``, and never creates the
  file: once the backend removed its directory, the engine's later records go nowhere.
* ``PhaseWatcher.stop`` reads what is left, then returns; no callback runs after it returned.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.core.json_log import root_logs_json
from eagle3.server.backends.base import ProgressCallback

logger = logging.getLogger(__name__)
LOG_NAME = "vllm-phases.log"  # in the backend's private phase directory, removed with it
CONFIG_NAME = "vllm-logging.json"
MAX_LOG_BYTES = 1 << 20  # the handler stops appending beyond this (known lines only: a load writes ~2 KiB)
POLL_S = 0.25
HANDLER_NAME = "eagle3_phases"


@dataclass(frozen=True)
class PhaseEvent:
    """One recognised vLLM message: the ``/readyz`` phase text and its progress figure."""

    phase: str
    progress: float


@dataclass(frozen=True)
class Rule:
    """A message ``pattern`` (named groups) announces ``template`` at ``progress``. The template may use
    the groups and ``{checkpoint}`` / ``{kv}``: " (N GiB checkpoint)" / " (N GiB)" from earlier lines."""

    pattern: re.Pattern[str]
    progress: float
    template: str


CHECKPOINT_GIB = re.compile(r"Checkpoint size: (?P<gib>-?[\d.]+) GiB")
KV_AVAILABLE_GIB = re.compile(r"Available KV cache memory: (?P<gib>-?[\d.]+) GiB")
KV_RESERVED_GIB = re.compile(r"reserved (?P<gib>-?[\d.]+) GiB memory for KV Cache")
KV_CPU_GIB = re.compile(r"(?:Explicitly|Auto) set \((?P<gib>-?[\d.]+)/[\d.]+\) GiB for KV cache")

# The stable parts of vLLM 0.32's format strings (file and function cited; tests/unit/test_vllm_phases.py
# feeds the formatted lines), in the order the engine logs them.
RULES: tuple[Rule, ...] = (
    # v1/engine/core.py EngineCore.__init__: the engine core process is up
    Rule(re.compile(r"Initializing a V1 LLM engine \(v"), 0.06, "vLLM engine process started, starting workers"),
    # distributed/parallel_state.py init_distributed_environment (every worker)
    Rule(
        re.compile(r"world_size=(?P<n>\d+) rank=\d+ local_rank=\d+ distributed_init_method="),
        0.08,
        "initialising {n} worker(s)",
    ),
    # v1/worker/gpu_model_runner.py and v1/worker/cpu_model_runner.py load_model
    Rule(re.compile(r"Starting to load model "), 0.1, "loading weights"),
    # model_executor/model_loader/weight_utils.py (the checkpoint's size, logged before reading it)
    Rule(CHECKPOINT_GIB, 0.12, "loading weights ({gib} GiB checkpoint)"),
    # model_executor/model_loader/default_loader.py DefaultModelLoader.load_weights
    Rule(re.compile(r"Loading weights took (?P<s>-?[\d.]+) seconds"), 0.6, "weights loaded in {s} s{checkpoint}"),
    # v1/worker/gpu_model_runner.py GPUModelRunner.load_model (CUDA: memory per GPU)
    Rule(
        re.compile(r"Model loading took (?P<gib>-?[\d.]+) GiB memory and (?P<s>-?[\d.]+) seconds"),
        0.62,
        "weights loaded: {gib} GiB per GPU in {s} s; profiling memory",
    ),
    # compilation/monitor.py monitor_torch_compile (compile mode only)
    Rule(re.compile(r"Starting torch\.compile"), 0.64, "compiling the model (torch.compile)"),
    # v1/worker/cpu_model_runner.py CPUModelRunner.warming_up_model (compile mode, or an automatic KV size)
    Rule(re.compile(r"Warming up model for the compilation"), 0.66, "warming up the model (CPU)"),
    # compilation/monitor.py: the profiling run after compilation
    Rule(re.compile(r"Initial profiling/warmup run took (?P<s>-?[\d.]+) s"), 0.68, "memory profiling run took {s} s"),
    # v1/worker/cpu_model_runner.py CPUModelRunner.warming_up_model
    Rule(re.compile(r"Warming up done\."), 0.68, "model warmed up (CPU)"),
    # v1/worker/gpu_model_runner.py GPUModelRunner.profile_cudagraph_memory
    Rule(re.compile(r"Profiling CUDA graph memory"), 0.7, "profiling CUDA graph memory"),
    # v1/worker/gpu_worker.py Worker.determine_available_memory (profiled; or kv_cache_memory_bytes given)
    Rule(KV_AVAILABLE_GIB, 0.75, "memory profiled: {gib} GiB for the KV cache"),
    Rule(KV_RESERVED_GIB, 0.75, "KV cache memory: {gib} GiB (set)"),
    # v1/worker/cpu_worker.py CPUWorker.determine_available_memory
    Rule(KV_CPU_GIB, 0.75, "KV cache memory: {gib} GiB"),
    # v1/core/kv_cache_utils.py update_kv_cache_capacity (engine core; device "GPU", "CPU", ...)
    Rule(
        re.compile(r"(?P<device>\w+) KV cache size: (?P<tokens>[\d,]+) tokens"),
        0.8,
        "{device} KV cache allocated: {tokens} tokens{kv}",
    ),
    # v1/worker/gpu_model_runner.py GPUModelRunner.capture_model (logged before the first graph)
    Rule(re.compile(r"Torch profiler (?:dis|en)abled for CUDA graph capture"), 0.85, "capturing CUDA graphs"),
    # v1/worker/gpu_model_runner.py GPUModelRunner.capture_model
    Rule(
        re.compile(r"Graph capturing finished in (?P<s>-?[\d.]+) secs, took (?P<gib>-?[\d.]+) GiB"),
        0.9,
        "CUDA graphs captured in {s} s ({gib} GiB)",
    ),
    # v1/engine/core.py EngineCore._initialize_kv_caches: the engine is up
    Rule(
        re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<s>-?[\d.]+) s"),
        0.93,
        "vLLM engine ready (profiling, KV cache, warm-up took {s} s)",
    ),
)

# figures a later phase text repeats: (pattern, key)
_FACTS = (
    (CHECKPOINT_GIB, "checkpoint_gib"),
    (KV_AVAILABLE_GIB, "kv_gib"),
    (KV_RESERVED_GIB, "kv_gib"),
    (KV_CPU_GIB, "kv_gib"),
)


def parse_line(line: str, facts: dict[str, str] | None = None) -> PhaseEvent | None:
    """The phase a vLLM log line announces, or None for any other line. ``facts`` (updated in place)
    carries figures from earlier lines into later phase texts (the KV cache's GiB next to its tokens)."""
    facts = {} if facts is None else facts
    for pattern, key in _FACTS:
        if (found := pattern.search(line)) is not None:
            facts.setdefault(key, found["gib"])
    for rule in RULES:
        if (match := rule.pattern.search(line)) is not None:
            checkpoint = f" ({facts['checkpoint_gib']} GiB checkpoint)" if "checkpoint_gib" in facts else ""
            kv = f" ({facts['kv_gib']} GiB)" if "kv_gib" in facts else ""
            groups = match.groupdict()
            if groups.get("s") is not None:  # seconds: 612.43 -> "612", 0.66 -> "0.7"
                seconds = float(groups["s"])
                groups["s"] = f"{seconds:.0f}" if abs(seconds) >= 100 else f"{seconds:.1f}"
            return PhaseEvent(rule.template.format(checkpoint=checkpoint, kv=kv, **groups), rule.progress)
    return None


def is_phase_line(message: str) -> bool:
    return any(rule.pattern.search(message) for rule in RULES)


class PhaseTracker:
    """Feeds lines in, reports each event that raises the progress (the module's monotonic invariant)."""

    def __init__(self, progress: ProgressCallback, floor: float = 0.0) -> None:
        self._progress = progress
        self.last = floor
        self.facts: dict[str, str] = {}
        self.seen: list[PhaseEvent] = []  # every event reported, in order

    def feed(self, line: str) -> PhaseEvent | None:
        event = parse_line(line, self.facts)
        if event is None or event.progress <= self.last:
            return None
        self.last = event.progress
        self.seen.append(event)
        self._progress(event.phase, event.progress)
        return event


class PhaseFileHandler(logging.Handler):
    """Runs in every vLLM process (built by ``logging.config.dictConfig`` from ``logging_config``):
    appends each record ``is_phase_line`` knows to ``path`` as one line (module docstring)."""

    def __init__(self, path: str, level: int | str = logging.INFO) -> None:
        super().__init__(level)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if not is_phase_line(message):
                return
            data = (" ".join(message.splitlines()) + "\n").encode("utf-8", "replace")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: a removed dir stays removed
        except FileNotFoundError:
            return
        except Exception:  # noqa: BLE001 (logging must never break the engine)
            self.handleError(record)
            return
        try:
            if os.fstat(fd).st_size + len(data) <= MAX_LOG_BYTES:
                os.write(fd, data)
        except OSError:
            pass
        finally:
            os.close(fd)


def logging_config(default: Mapping[str, Any], path: str, level: str, json_lines: bool = False) -> dict[str, Any]:
    """vLLM's ``dictConfig`` (``default``: ``vllm.logger.DEFAULT_LOGGING_CONFIG``, console handler at
    ``level``, as vLLM itself refreshes it) plus ``PhaseFileHandler`` on the ``vllm`` logger, whose level
    is lowered to INFO at most so the phase records reach the file while the console shows what it did.
    ``json_lines`` (``serve --log-format json``): the console writes eagle3's JSON lines
    (``eagle3.core.json_log.JsonFormatter``) instead of vLLM's text, in every vLLM process."""
    config = copy.deepcopy(dict(default))
    console = config["handlers"]["vllm"]
    console["level"] = level
    if json_lines:
        config.setdefault("formatters", {})["eagle3_json"] = {"()": "eagle3.core.json_log.JsonFormatter"}
        console["formatter"] = "eagle3_json"
    for formatter in config.get("formatters", {}).values():
        if "log_level" in formatter:
            formatter["log_level"] = level
    config["handlers"][HANDLER_NAME] = {"()": f"{__name__}.PhaseFileHandler", "path": path, "level": "INFO"}
    vllm_logger = config["loggers"]["vllm"]
    vllm_logger["handlers"] = [*vllm_logger.get("handlers", []), HANDLER_NAME]
    numeric = logging.getLevelName(level.upper())
    vllm_logger["level"] = "INFO" if isinstance(numeric, int) and numeric > logging.INFO else level
    return config


def operator_logging(engine_args: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """Why vLLM's logging is the operator's to configure here (then no phases are read), or None."""
    for key in ("logging_config", "log_config_file"):
        if key in engine_args:
            return f"--engine-arg {key} is set"
    if environ.get("VLLM_LOGGING_CONFIG_PATH"):
        return f"VLLM_LOGGING_CONFIG_PATH={environ['VLLM_LOGGING_CONFIG_PATH']} is set"
    if environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return "VLLM_CONFIGURE_LOGGING=0 is set"
    return None


def engine_phase_log(directory: Path, engine_kwargs: dict[str, Any], environ: Mapping[str, str]) -> Path | None:
    """Arm the phase log for one engine: write the ``dictConfig`` JSON into ``directory`` (private to the
    backend, removed when it closes), create the empty log there, set ``engine_kwargs["logging_config"]``
    and return the log's path. None, and a log line saying why, when the operator configures vLLM's
    logging (``operator_logging``): theirs is kept and ``/readyz`` shows elapsed/expected time only."""
    reason = operator_logging(engine_kwargs, environ)
    if reason is not None:
        logger.info(
            "vLLM's logging is configured by the operator (%s): /readyz reports elapsed and expected "
            "load time, not the engine's phases",
            reason,
        )
        return None
    try:  # a phase hint must never fail the load
        from vllm import envs
        from vllm.config.logging import LoggingConfig
        from vllm.logger import DEFAULT_LOGGING_CONFIG

        log = directory / LOG_NAME
        log.touch(mode=0o600)
        config_path = directory / CONFIG_NAME
        # the console's level as vLLM would set it: --engine-arg log_level, else VLLM_LOGGING_LEVEL (a
        # custom dictConfig is authoritative in vLLM, so the level goes into it)
        level = str(engine_kwargs.get("log_level") or envs.VLLM_LOGGING_LEVEL).upper()
        config = logging_config(DEFAULT_LOGGING_CONFIG, str(log), level, json_lines=root_logs_json())
        config_path.write_text(json.dumps(config, indent=1), encoding="utf-8")
        engine_kwargs["logging_config"] = LoggingConfig(pylogging_config_file=str(config_path))
    except (ImportError, OSError, KeyError, TypeError, ValueError) as exc:
        logger.warning(
            "vLLM's start-up phases are not available (%s: %s): /readyz reports elapsed and expected load time only",
            type(exc).__name__,
            exc,
        )
        return None
    return log


class PhaseWatcher:
    """Tails ``path`` on thread ``eagle3-vllm-phases`` every ``poll_s`` and feeds ``tracker`` whole lines
    (a partial last line waits for its newline); a missing file is waited for. ``stop`` is idempotent."""

    def __init__(self, path: Path, tracker: PhaseTracker, poll_s: float = POLL_S) -> None:
        self.path, self.tracker, self.poll_s = path, tracker, poll_s
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-vllm-phases", daemon=True)

    def __enter__(self) -> PhaseWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.poll_s)
            try:
                self._drain()
            except Exception:  # a phase hint must never fail the load
                logger.exception("reading vLLM's phase log %s", self.path)
                return
            if stopping:
                return

    def _drain(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self.tracker.feed(line.decode("utf-8", "replace"))
