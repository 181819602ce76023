"""Command-line helpers every service's parser shares: number types that
argparse reports naming the flag, and a parser that refuses instead of exiting.

The types raise ``argparse.ArgumentTypeError``, which argparse turns into
``argument --flag: must be >= 0, got -1`` (exit 2). :class:`CheckingParser`
raises :class:`ArgsRefused` with that same line instead of printing usage and
exiting: a launcher (``llmesh up --router-arg/--retriever-arg``) checks the
flags it passes on with the service's own parser before it starts anything.
"""

from __future__ import annotations

import argparse
import math
from typing import NoReturn


class ArgsRefused(ValueError):
    """A command line the parser refused; the message is argparse's one line."""


class CheckingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`ArgsRefused` where argparse
    would print usage and exit 2 (an unknown flag, a bad value, a missing one)."""

    def error(self, message: str) -> NoReturn:
        raise ArgsRefused(message)


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number >= 0."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = int(_number(text, int))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _number(text, float)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
