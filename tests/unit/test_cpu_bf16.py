"""The bf16 probe (draft_trainer/cpu_bf16.py): bf16 autocast on a CPU that emulates bf16 (AVX2 only) took 25.8 s
a training step where fp32 takes ~0.8 s, and nothing said why. The probe's verdict agrees with the CPU's own
flags where they settle the question, and ``eagle3 demo --bf16`` follows the verdict, saying so."""

from __future__ import annotations

import platform

import pytest
import torch

from eagle3.demo import cpu_bf16
from eagle3.draft_trainer.cpu_bf16 import SLOW_RATIO, CpuBf16Speed, cpu_bf16_speed


def test_the_verdict_is_the_measured_ratio() -> None:
    assert not CpuBf16Speed(fp32_s=0.010, bf16_s=0.008).slow  # native: bf16 as fast or faster
    assert not CpuBf16Speed(fp32_s=0.010, bf16_s=0.010 * SLOW_RATIO).slow
    emulated = CpuBf16Speed(fp32_s=0.015, bf16_s=0.75)  # this VM's EPYC (AVX2), measured
    assert emulated.slow and emulated.ratio == pytest.approx(50.0)
    assert "50.0x fp32's time" in emulated.describe()


def test_the_probe_agrees_with_the_cpus_bf16_units() -> None:
    speed = cpu_bf16_speed()
    assert speed.fp32_s > 0 and speed.bf16_s > 0
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        assert not speed.slow, speed.describe()  # bf16 matmul units: bf16 is not slower than fp32 by 4x
    elif platform.machine() in ("x86_64", "AMD64") and not torch.cpu._is_avx512_supported():
        assert speed.slow, speed.describe()  # AVX2 only: every bf16 matmul emulated
    else:
        pytest.skip(f"no flag settles it on this CPU ({torch.backends.cpu.get_cpu_capability()}): {speed.describe()}")


def test_demo_bf16_follows_the_probe_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cpu_bf16(False) is False  # never asked, never probed into bf16
    slow = cpu_bf16_speed().slow
    assert cpu_bf16(True) is (torch.cuda.is_available() or not slow)
    said = capsys.readouterr().out
    assert ("no native bf16" in said and "the draft trains in fp32" in said) is (slow and not torch.cuda.is_available())
