"""The trainer's user-facing errors (``eagle3`` prints them as one line and exits 1)."""

from __future__ import annotations

from eagle3.core.errors import Eagle3Error


class TrainerError(Eagle3Error, ValueError):
    """Base of the errors a user can fix (bad config, bad data, missing files)."""


class ConfigError(TrainerError):
    """A config file or ``--set key=value`` override names an unknown key or a bad value."""


class DataError(TrainerError):
    """The features directory cannot feed this training run (empty, wrong layers, sample too long)."""


class CheckpointError(TrainerError):
    """A run directory or export lacks a file, or its shapes disagree with the config."""
