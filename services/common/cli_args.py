"""Command-line helpers every service's parser shares: number types that
argparse reports naming the flag, and a parser that refuses instead of exiting.

The types raise ``argparse.ArgumentTypeError``, which argparse turns into
``argument --flag: must be >= 0, got -1`` (exit 2). :class:`CheckingParser`
raises :class:`ArgsRefused` with that same line instead of printing usage and
exiting: a launcher (``llmesh up --router-arg/--retriever-arg``) checks the
flags it passes on with the service's own parser before it starts anything.

A flag whose default comes from an environment variable (``--port`` from
``LLMESH_PORT``) takes :func:`env_default` as its default and
:func:`env_checked` around its type: a bad value is refused when the
arguments are parsed, exit 2 as for the flag, naming the variable and its
value (:func:`env_refusal`), not only the flag the user did not type.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class ArgsRefused(ValueError):
    """A command line the parser refused; the message is argparse's one line."""


class CheckingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`ArgsRefused` where argparse
    would print usage and exit 2 (an unknown flag, a bad value, a missing one)."""

    def error(self, message: str) -> NoReturn:
        raise ArgsRefused(message)


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, str]:
    """The options ``argv`` sets, resolved as ``parser`` resolves them
    (abbreviations, ``--flag=value``): destination -> the option's first
    name. ``argv`` must already parse (required options are not required
    here). Mutates ``parser``'s defaults: pass a fresh one."""
    actions = [a for a in parser._actions if a.option_strings]  # noqa: SLF001 - no public list
    for action in actions:
        action.default = None  # every action (append, count, store_true) starts from None
        action.required = False
    parser.set_defaults(**{action.dest: None for action in actions})
    namespace = parser.parse_args(argv)
    return {action.dest: action.option_strings[0] for action in actions
            if getattr(namespace, action.dest, None) is not None}


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` and, with ``high``, <=
    ``high`` (text that is no whole number is refused saying so, with the
    bounds)."""
    what = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value
    return parse


def number(low: float, *, inclusive: bool = False, finite: bool = True,
           high: float | None = None, high_inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a number above ``low`` (or equal to it with
    ``inclusive``), finite unless ``finite`` is False (NaN never passes), and
    with ``high`` at most ``high`` (below it without ``high_inclusive``). Text
    that is no number is refused with the same words for what is accepted
    (``expected a number in (0, 1], got 'abc'``)."""
    if high is not None:
        what = (f"a number in {'[' if inclusive else '('}{low:g}, {high:g}"
                f"{']' if high_inclusive else ')'}")
    else:
        what = f"{'a finite number' if finite else 'a number'} {'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        above = value >= low if inclusive else value > low
        below = high is None or (value <= high if high_inclusive else value < high)
        if not (above and below) or (finite and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


#: A whole number >= 0.
non_negative_int = integer(0)
#: A whole number >= 1.
positive_int = integer(1)
#: A finite number >= 0.
non_negative_float = number(0, inclusive=True)
#: A number > 0 (``inf`` allowed, as the engine's flags always took it).
positive_float = number(0, finite=False)


def env_refusal(variable: str, value: str, why: object) -> str:
    """The one-line refusal of an environment variable's value:
    ``LLMESH_PORT='abc': port must be an integer, got 'abc'``."""
    return f"{variable}={value!r}: {why}"


class EnvText(str):
    """An environment variable's value standing as a flag's default;
    ``variable`` is its name, so that the flag's type (:func:`env_checked`)
    names the variable when it refuses the value."""

    variable: str

    def __new__(cls, value: str, variable: str) -> EnvText:
        text = super().__new__(cls, value)
        text.variable = variable
        return text


def env_default(variable: str, fallback: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A flag's default: the value of ``variable`` in ``environ`` (default:
    the process environment, read now) as :class:`EnvText`, else
    ``fallback`` (also for an empty value). argparse passes a text default
    through the flag's type when the flag is not given, so a bad value is
    refused only by a command that has the flag (``llmesh up``, not
    ``llmesh --help``)."""
    value = (os.environ if environ is None else environ).get(variable)
    return EnvText(value, variable) if value else fallback


def env_checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` (an argparse type) that words its refusal of an
    :class:`EnvText` default as :func:`env_refusal` (the variable, the
    value, then why), and of anything else as ``parse`` does."""
    def checked(text: str) -> T:
        try:
            return parse(text)
        except (argparse.ArgumentTypeError, ValueError) as error:
            if isinstance(text, EnvText):
                raise argparse.ArgumentTypeError(
                    env_refusal(text.variable, str(text), error)) from None
            raise
    checked.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid NAME value"
    return checked
