"""Value types for the subcommands' flags: each rejects a bad value with a one-line argparse error."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def positive_int(text: str) -> int:
    """An integer >= 1 (``--workers``, ``--repeats``, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (``16,32,64``)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return [positive_int(p) for p in parts]


def power_of_two(text: str) -> int:
    """A block size: an integer >= 1 that is a power of two."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {value}")
    return value


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list whose items are each one of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [p.strip() for p in text.split(",")]
        bad = [p for p in items if p not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}: choose from {', '.join(choices)}")
        return items

    return parse
