"""The root of eagle3's error tree and the errors of the features directory.

``Eagle3Error`` is the one root: every error class eagle3 defines derives from it (checked by
tests/unit/test_error_root.py, which walks the modules), keeping ``ValueError``/``RuntimeError`` as a
second base where callers catch those. This module is stdlib-only and imports nothing of ours, so the
protocol (``core/protocol``, stdlib-only) stands on it too. The console (``eagle3/cli.py``) catches the
root and prints a one-line error. The SDK's tree, with these re-exported, is documented in
``eagle3.client.errors`` and importable from ``eagle3`` (``from eagle3 import APIError``).
"""

from __future__ import annotations


class Eagle3Error(Exception):
    """Base class of every error eagle3 raises on purpose."""


class IncompatibleError(Eagle3Error):
    """The server, the prepared dataset and/or the features directory were made for different models."""


class FeaturesWriteError(Eagle3Error):
    """A features directory cannot be written; the shards already in its manifest are intact."""


class FeaturesLockedError(FeaturesWriteError):
    """Another writer (an ``eagle3 extract`` into the same ``--out``) holds the features directory."""


class InsufficientDiskError(FeaturesWriteError):
    """Not enough free disk for the features still to be written."""
