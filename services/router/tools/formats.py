"""The tool format each served model uses (the router's ``--tool-call-format``).

``--tool-call-format [MODEL=]FORMAT`` (repeatable; without ``MODEL=`` it is
every model's default): ``auto`` (the default) picks the format for the
model, ``hermes`` forces the Hermes format (:mod:`.hermes`), ``none`` turns
tool calling off for the model (a request with ``tools`` is
FAILED_PRECONDITION naming ``chat.tools``). ``auto`` is Hermes for every
model today: rendering through a chat template's own tool section is not
implemented, and neither served template (SmolLM2's ChatML, Gemma's) has one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ToolCallFormat(enum.Enum):
    """How a model's tools, calls and results are written (see the module doc)."""

    AUTO = "auto"
    HERMES = "hermes"
    NONE = "none"


def parse_flag(text: str) -> tuple[str, ToolCallFormat]:
    """``[MODEL=]FORMAT`` → (model, or "" for every model; format).

    Raises:
      ValueError: an unknown format.
    """
    model, sep, name = text.rpartition("=")
    try:
        return (model.strip() if sep else "", ToolCallFormat(name.strip()))
    except ValueError:
        raise ValueError(f"--tool-call-format {text!r}: expected [MODEL=]FORMAT with FORMAT "
                         f"one of {', '.join(f.value for f in ToolCallFormat)}") from None


def resolve(formats: Mapping[str, ToolCallFormat], model: str) -> ToolCallFormat:
    """The format ``model`` uses: its own flag, else the default flag, else
    ``auto``; ``auto`` resolves to HERMES (module doc)."""
    chosen = formats.get(model, formats.get("", ToolCallFormat.AUTO))
    return ToolCallFormat.HERMES if chosen is ToolCallFormat.AUTO else chosen


__all__ = ["ToolCallFormat", "parse_flag", "resolve"]
