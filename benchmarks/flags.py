"""argparse ``type=`` checks shared by the benchmarks' command lines.

A value that cannot work is an argparse usage error naming the flag (exit 2),
not a traceback later in the run. Each factory returns the parse function.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.common.cli_args import integer, number
from services.engine.config import parse_bytes

__all__ = ["integer", "integers", "number", "size"]


def integers(low: int) -> Callable[[str], list[int]]:
    """A comma list of integers >= ``low`` (``"1,8"``); empty items skipped, none at all refused."""
    item = integer(low)

    def parse(text: str) -> list[int]:
        values = [item(part) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected integers like 1,8, got {text!r}")
        return values
    return parse


def size(text: str) -> str:
    """A byte size as the engine's flags read it (``512MiB``, ``8GiB``), kept as written."""
    parse_bytes(text)
    return text
