"""The root of eagle3's error tree and the errors of the features directory.

They live in the core because the features writer (core) raises them; the SDK's full tree, with these
re-exported, is documented in ``eagle3.client.errors``.
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
