"""What the vllm backend's handover costs per GB, outside the engine: vLLM's own writer and reader
(the connector's ``_write_tensors`` = safetensors ``save_file`` under an exclusive flock, the stock
``load_hidden_states`` / ``cleanup_hidden_states``) through a tmpfs directory, plus the backend's
per-sample checks, against a plain in-memory copy of the same bytes. Prints JSON.

    python -m bench.handover [--tokens 1024] [--hidden-size 4096] [--layers 4] [--samples 32] [--dir /dev/shm]

One sample = ``tokens x layers x hidden`` bf16 states (1,024 x 4 x 4,096 = 32 MiB: an 8B verifier's
four taps of a 1k-token chat). Each stage runs single-threaded, as in the server (the engine's writer
thread writes, the scheduler thread reads), so ``s_per_gb`` is per core.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.server.backends.vllm import all_finite
from eagle3.server.backends.vllm_connector import Eagle3HiddenStatesConnector, _CompletedCopy


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())  # noqa: S108
    args = parser.parse_args()
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(args.tokens, args.layers, args.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.arange(args.tokens, dtype=torch.int64)
    gb = states.numel() * 2 * args.samples / 1e9
    times: dict[str, float] = {"memcpy": 0.0, "write": 0.0, "read": 0.0, "check": 0.0, "cleanup": 0.0}
    with tempfile.TemporaryDirectory(prefix="eagle3-handover-bench-", dir=args.dir) as tmp:
        for i in range(args.samples):
            t0 = time.perf_counter()
            copy = states.clone()  # the floor: one copy of the bytes in memory
            t1 = time.perf_counter()
            path = os.path.join(tmp, f"req-{i}.safetensors")
            lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            done: Any = _CompletedCopy()
            Eagle3HiddenStatesConnector._write_tensors({"hidden_states": copy, "token_ids": ids}, done, path, lock_fd)
            t2 = time.perf_counter()
            data = load_hidden_states(path)
            t3 = time.perf_counter()
            hidden = data["hidden_states"]  # the backend's checks (server/backends/vllm.py, _checked)
            ok = data["token_ids"].tolist() == ids.tolist() and all_finite(hidden)
            hidden = hidden.contiguous()
            t4 = time.perf_counter()
            cleanup_hidden_states(path)
            t5 = time.perf_counter()
            if not (ok and torch.equal(hidden, states)):
                raise SystemExit(f"sample {i}: the handover changed the states")
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                times[key] += dt
    handover = times["write"] + times["read"] + times["check"] + times["cleanup"]
    print(json.dumps({
        "bench": "vllm_handover", "dir": args.dir, "sample_mb": round(states.numel() * 2 / 2**20, 1),
        "samples": args.samples, "gb": round(gb, 3),
        "s_per_gb": {k: round(v / gb, 3) for k, v in times.items()} | {"handover_total": round(handover / gb, 3)},
        "handover_over_memcpy": round(handover / times["memcpy"], 2),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
