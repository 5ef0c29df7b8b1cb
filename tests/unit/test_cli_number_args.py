"""The argparse number types of ``core/cli_args.py`` share one parse-and-check helper: each accepts
exactly its range and refuses the rest with a usage error that names what it expected and what it got
(text that is not a number quoted, a parsed value out of range as the value; ``nan`` refused)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from eagle3.core.cli_args import (
    fraction_below_one,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability_mass,
)


@pytest.mark.parametrize(
    ("parse", "text", "want"),
    [
        (positive_int, "1", 1),
        (positive_int, "640", 640),
        (non_negative_int, "0", 0),
        (non_negative_int, "3", 3),
        (positive_float, "0.8", 0.8),
        (positive_float, "2", 2.0),
        (non_negative_float, "0", 0.0),
        (non_negative_float, "1e-3", 1e-3),
        (fraction_below_one, "0", 0.0),
        (fraction_below_one, "0.05", 0.05),
        (probability_mass, "1", 1.0),
        (probability_mass, "0.95", 0.95),
    ],
)
def test_accepts_its_range(parse: Callable[[str], float], text: str, want: float) -> None:
    value = parse(text)
    assert value == want and type(value) is type(want)


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (positive_int, "0", "expected a positive integer, got 0"),
        (positive_int, "-1", "expected a positive integer, got -1"),
        (positive_int, "x", "expected a positive integer, got 'x'"),
        (positive_int, "1.5", "expected a positive integer, got '1.5'"),
        (non_negative_int, "-1", "expected an integer >= 0, got -1"),
        (non_negative_int, "x", "expected an integer >= 0, got 'x'"),
        (positive_float, "0", "expected a positive number, got 0.0"),
        (positive_float, "-0.1", "expected a positive number, got -0.1"),
        (positive_float, "nan", "expected a positive number, got nan"),
        (positive_float, "x", "expected a positive number, got 'x'"),
        (non_negative_float, "-0.1", "expected a number >= 0, got -0.1"),
        (non_negative_float, "nan", "expected a number >= 0, got nan"),
        (non_negative_float, "", "expected a number >= 0, got ''"),
        (fraction_below_one, "1", "expected a number in [0, 1), got 1.0"),
        (fraction_below_one, "-0.01", "expected a number in [0, 1), got -0.01"),
        (fraction_below_one, "nan", "expected a number in [0, 1), got nan"),
        (probability_mass, "0", "expected a number in (0, 1], got 0.0"),
        (probability_mass, "1.5", "expected a number in (0, 1], got 1.5"),
    ],
)
def test_refuses_the_rest_saying_what_it_expected(parse: Callable[[str], float], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        parse(text)
    assert str(caught.value) == message


def test_a_parser_turns_the_refusal_into_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="eagle3 distill")
    parser.add_argument("--sampled-replies", type=non_negative_int, default=0)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--sampled-replies", "-1"])
    assert exited.value.code == 2
    assert "argument --sampled-replies: expected an integer >= 0, got -1" in capsys.readouterr().err
