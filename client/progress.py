"""``eagle3 extract``'s progress: tokens (with samples and wire MB/s beside them) through
``eagle3.core.progress.ProgressBar``: a tqdm bar on a terminal or in Jupyter, a plain line every
30 s otherwise (k8s logs, CI), nothing with ``enabled=False`` (``--no-progress``)."""

from __future__ import annotations

import time
from typing import TextIO

from eagle3.core.progress import ProgressBar


class Progress:
    def __init__(
        self, n_samples: int, n_tokens: int, *, enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.total_samples = n_samples
        self.samples = 0
        self.tokens = 0
        self.wire_bytes = 0
        self.started = time.monotonic()
        self.bar = ProgressBar("extract", n_tokens, unit="tok", unit_scale=True, enabled=enabled, stream=stream)

    def update(self, n_samples: int, n_tokens: int, wire_bytes: int) -> None:
        self.samples += n_samples
        self.tokens += n_tokens
        self.wire_bytes = wire_bytes
        elapsed_s = max(time.monotonic() - self.started, 1e-6)
        self.bar.set_postfix(
            samples=f"{self.samples}/{self.total_samples}", wire=f"{wire_bytes / elapsed_s / 1e6:.1f}MB/s"
        )
        self.bar.update(n_tokens)

    def line(self) -> str:
        return self.bar.line()

    def close(self) -> None:
        self.bar.close()
