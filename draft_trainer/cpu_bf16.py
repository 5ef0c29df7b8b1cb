"""Does this CPU compute bf16 natively? A probe, because bf16 autocast without it is a trap.

On a CPU with AVX512-BF16 or AMX, bf16 autocast trains the draft about 1.2x faster than fp32
(docs/training.md, "Speed on this CPU"). On one without (an AVX2-only EPYC, as the project's VM became
on 2026-12-06) torch emulates every bf16 matmul: a training step took 25.8 s where fp32 takes ~0.8 s, and
the probe below measures bf16 30-36x slower than fp32 on one core. The flag names no machine, so the question is
answered by timing the thing itself: one draft-shaped matmul and its backward, fp32 against bf16 autocast,
the best of a few repetitions each, on one thread (a per-core property; with 2 threads on a busy 2-core
machine the fp32 time swings 10x while one thread's stays put: 36x measured either way, idle or loaded).

    speed = cpu_bf16_speed()          # cached per process; ~1 s on a CPU without native bf16
    if speed.slow: ...                # bf16 autocast would cost speed.ratio x fp32's time here
    warn_if_emulated()                # the trainer, when asked for bf16 autocast on the CPU

The trainer warns when asked for bf16 autocast on such a CPU (the user's choice stands); ``eagle3 demo
--bf16`` keeps fp32 there and says why (tests/unit/test_cpu_bf16.py).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

SLOW_RATIO = 4.0  # bf16 / fp32 time above which bf16 is emulated (native: ~0.5-1x; emulated: 30-36x, measured)
PROBE_SHAPE = (256, 576, 768)  # tokens x hidden -> out: one of the draft's MLP matmuls at the demo's size
PROBE_REPEATS = 3
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuBf16Speed:
    fp32_s: float  # best time of one forward + backward in fp32
    bf16_s: float  # the same under bf16 autocast

    @property
    def ratio(self) -> float:
        return self.bf16_s / max(self.fp32_s, 1e-9)

    @property
    def slow(self) -> bool:
        return self.ratio > SLOW_RATIO

    def describe(self) -> str:
        return (
            f"bf16 autocast measured {self.ratio:.1f}x fp32's time on this CPU ({1e3 * self.bf16_s:.1f} ms against "
            f"{1e3 * self.fp32_s:.1f} ms for a {PROBE_SHAPE[0]}x{PROBE_SHAPE[1]}x{PROBE_SHAPE[2]} matmul and its "
            f"backward; {torch.backends.cpu.get_cpu_capability()})"
        )


def _best_time_s(a: torch.Tensor, w: torch.Tensor, autocast: bool) -> float:
    best = float("inf")
    for i in range(PROBE_REPEATS + 1):  # the first run warms up (allocations, kernel choice) and is not counted
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            (a @ w).float().sum().backward()  # type: ignore[no-untyped-call]
        if i:
            best = min(best, time.perf_counter() - started)
        w.grad = None
    return best


@functools.cache
def cpu_bf16_speed() -> CpuBf16Speed:
    """fp32 against bf16 autocast on one core of this CPU (cached per process; torch's thread count is restored)."""
    tokens, hidden, out = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(tokens, hidden, generator=generator)
    w = torch.randn(hidden, out, generator=generator).requires_grad_(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return CpuBf16Speed(fp32_s=_best_time_s(a, w, False), bf16_s=_best_time_s(a, w, True))
    finally:
        torch.set_num_threads(threads)


def warn_if_emulated() -> bool:
    """Log a warning for a user who asked for bf16 autocast on a CPU without native bf16; True if it did."""
    speed = cpu_bf16_speed()
    if speed.slow:
        logger.warning(
            "autocast_bf16 is on, but this CPU has no native bf16: %s. Training goes on in bf16 as asked; set "
            "autocast_bf16=false (eagle3 demo: drop --bf16) to train in fp32, which is faster here",
            speed.describe(),
        )
    return speed.slow
