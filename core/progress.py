"""Progress for prepare, extract, verify, train and eval: a tqdm bar where a person watches, plain
log lines where nobody does.

* A terminal (the stream is a TTY) or a Jupyter kernel: ``tqdm.auto`` (a widget in a notebook, a
  redrawn line in a terminal).
* Anything else (a k8s Job's log, ``| tee``, CI, a file): one plain line every ``interval_s``
  (default 30, ``EAGLE3_PROGRESS_INTERVAL_S``) and one at the end unless the last line already showed
  the final count, each ending in a newline and containing no ``\\r`` and no escape codes; the text is
  tqdm's own ``format_meter`` (count, rate, elapsed, ETA), so both modes read the same. The console
  (``eagle3/cli.py``) also turns Hugging Face's own bars off there (``quiet_foreign_bars``): their
  ``\\r`` frames are noise in a log.
* ``enabled=False``: nothing.

tqdm is used for the bar and its formatting rather than a hand-written line: it handles terminal
widths, notebooks and rate smoothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm as tqdm_std

INTERVAL_ENV = "EAGLE3_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 30.0


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython's ZMQ shell); IPython is not imported to find out."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class ProgressBar:
    """``update(n)`` / ``set_postfix(**fields)`` / ``close()``; see the module docstring for the modes."""

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        *,
        unit: str = "it",
        unit_scale: bool = False,
        initial: float = 0,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.desc, self.total, self.unit, self.unit_scale = desc, total, unit, unit_scale
        self.n = initial
        self.initial = initial
        self.postfix: dict[str, Any] = {}
        self.started = time.monotonic()
        self.interval_s = (
            interval_s if interval_s is not None else float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        )
        self._next_line = self.started + self.interval_s
        self._closed = False
        self._written: tuple[float, str] | None = None  # (count, postfix) of the last plain line
        self.mode = "off" if enabled is False else "bar" if _interactive(self.stream) else "lines"
        self._bar: Any = None
        if self.mode == "bar":
            if in_notebook():
                from tqdm.auto import tqdm as tqdm_auto

                self._bar = tqdm_auto(total=total, desc=desc, unit=unit, unit_scale=unit_scale, initial=initial)
            else:
                self._bar = tqdm_std(
                    total=total,
                    desc=desc,
                    unit=unit,
                    unit_scale=unit_scale,
                    initial=initial,
                    file=self.stream,
                    dynamic_ncols=True,
                    mininterval=0.5,
                )

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines" and time.monotonic() >= self._next_line:
            self._next_line = time.monotonic() + self.interval_s
            self._write_line()

    def set_postfix(self, **fields: Any) -> None:
        self.postfix = fields
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)

    def line(self) -> str:
        """The current state as one line of text (tqdm's ``format_meter``; the rate counts from ``initial``)."""
        elapsed_s = time.monotonic() - self.started
        rate = (self.n - self.initial) / elapsed_s if elapsed_s > 0 else None
        postfix = ", ".join(f"{k}={v}" for k, v in self.postfix.items()) or None
        return str(
            tqdm_std.format_meter(
                self.n,
                self.total,
                elapsed_s,
                ncols=0,
                prefix=self.desc,
                unit=self.unit,
                unit_scale=self.unit_scale,
                rate=rate,
                postfix=postfix,
                initial=self.initial,
            )
        )

    def _write_line(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._written = (self.n, repr(self.postfix))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and self._written != (self.n, repr(self.postfix)):  # else it would repeat
            self._write_line()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def quiet_foreign_bars(stream: TextIO) -> None:
    """Where nobody watches ``stream`` (a log), turn off the progress bars of transformers and
    huggingface_hub (``HF_HUB_DISABLE_PROGRESS_BARS``, read when they are imported, also by child
    processes such as the demo's server): tqdm writes ``\\r`` frames even into a file. An operator's
    own setting wins."""
    if not _interactive(stream):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _interactive(stream: TextIO) -> bool:
    try:
        return stream.isatty() or in_notebook()
    except (AttributeError, ValueError):  # a closed or exotic stream
        return False
