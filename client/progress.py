"""A one-line progress display on stderr: samples, tokens/s, MB/s on the wire, ETA (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(
        self, n_samples: int, n_tokens: int, *, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total_samples = n_samples
        self.total_tokens = n_tokens
        self.samples = 0
        self.tokens = 0
        self.wire_bytes = 0
        self.started = time.monotonic()
        self._last_draw = 0.0

    def update(self, n_samples: int, n_tokens: int, wire_bytes: int) -> None:
        self.samples += n_samples
        self.tokens += n_tokens
        self.wire_bytes = wire_bytes
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= 0.5:
            self._last_draw = now
            self.stream.write("\r" + self.line() + "\033[K")
            self.stream.flush()

    def line(self) -> str:
        elapsed_s = max(time.monotonic() - self.started, 1e-6)
        tokens_per_s = self.tokens / elapsed_s
        left = self.total_tokens - self.tokens
        eta = _duration(left / tokens_per_s) if tokens_per_s > 0 else "?"
        percent = 100.0 * self.tokens / self.total_tokens if self.total_tokens else 100.0
        return (
            f"extract {self.samples}/{self.total_samples} samples {percent:5.1f}% | "
            f"{tokens_per_s:,.0f} tok/s | {self.wire_bytes / elapsed_s / 1e6:.1f} MB/s wire | "
            f"{_duration(elapsed_s)} elapsed, ETA {eta}"
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line() + "\033[K\n")
            self.stream.flush()
