"""Argument types and arguments shared by several ``eagle3`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from eagle3.core.errors import Eagle3Error
from eagle3.core.models import DEFAULT_MODEL

N = TypeVar("N", int, float)


def _checked_number(text: str, kind: Callable[[str], N], accept: Callable[[N], bool], expected: str) -> N:
    """``kind(text)`` if it parses and ``accept`` holds; else argparse's usage error saying ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not accept(value):  # nan fails every comparison: refused
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _checked_number(text, int, lambda v: v >= 1, "a positive integer")


def positive_int_list(text: str) -> tuple[int, ...]:
    """``"4"`` or ``"3,5,7"``: distinct positive integers, in the order given."""
    values = tuple(positive_int(part.strip()) for part in text.split(","))
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, got {text!r}")
    return values


def non_negative_int(text: str) -> int:
    return _checked_number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _checked_number(text, float, lambda v: v > 0, "a positive number")


def non_negative_float(text: str) -> float:
    return _checked_number(text, float, lambda v: v >= 0, "a number >= 0")


def fraction_below_one(text: str) -> float:
    return _checked_number(text, float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def probability_mass(text: str) -> float:
    return _checked_number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


MODEL_CHOICES_TEXT = (
    "a local Hugging Face checkpoint directory, an org/name already in the local Hugging Face cache "
    f"(never downloaded), or the embedded demo model's name {DEFAULT_MODEL}"
)
MODEL_REQUIRED = f"--model is required: pass the verifier as {MODEL_CHOICES_TEXT}"


class MissingModelError(Eagle3Error, ValueError):
    """A command that needs the verifier got no ``--model`` (nor, where it reads them, a variable or
    config key giving it). The console reports it as a usage error (exit status 2)."""

    def __init__(self, message: str = MODEL_REQUIRED) -> None:
        super().__init__(message)


def add_model_argument(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--model``. No default (the command calls ``require_model``), except where a caller passes
    one explicitly (``eagle3 demo``: the embedded model): a forgotten ``--model`` never silently
    means the 135M demo model."""
    shown = f" (default {default})" if default else " (required)"
    parser.add_argument("--model", default=default, help=f"the verifier: {MODEL_CHOICES_TEXT}{shown}")


def require_model(model: str | None, other_sources: str = "") -> str:
    """``model`` if given; else ``MissingModelError`` saying what to pass (and ``other_sources``, the
    command's other ways of giving it)."""
    if model is None or not model.strip():
        raise MissingModelError(f"{MODEL_REQUIRED} ({other_sources})" if other_sources else MODEL_REQUIRED)
    return model
