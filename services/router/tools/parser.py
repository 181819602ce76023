"""Generated text → content and tool-call pieces, incrementally.

A small state machine over text deltas (any split: one character, a
multi-token speculative delivery, or the whole answer from the response cache
at once) for the Hermes format (:mod:`.hermes`), whose envelope the grammar
fixes byte for byte:

``TEXT`` → (``<tool_call>``) → ``NAME`` (``\\n{"name": "`` … ``", "arguments": ``)
→ ``ARGUMENTS`` (a JSON object, its end found by bracket depth outside
strings) → ``CLOSE`` (``}\\n</tool_call>``) → ``BETWEEN`` (``\\n<tool_call>``
starts the next call).

In ``TEXT`` a suffix that could be the start of ``<tool_call>`` is held back
until it cannot (as stop strings are). Argument pieces are emitted as soon as
they arrive and concatenate to exactly the generated arguments text. Text the
grammar does not allow (only possible without a grammar) is passed through as
content.
"""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Callable

from services.common.wire.tools import ToolCallDelta
from services.router.tools.hermes import (
    ARGUMENTS_PREFIX,
    CALL_CLOSE,
    CALL_OPEN,
    NAME_PREFIX,
)

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """``call_`` + 24 random alphanumerics (vLLM's and OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class _State(enum.Enum):
    TEXT = "text"
    NAME = "name"
    ARGUMENTS = "arguments"
    CLOSE = "close"
    BETWEEN = "between"


class ToolCallParser:
    """Feeds text deltas, returns (content, call pieces) per delta.

    Attributes:
      calls: how many calls have started.
    """

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        self._state = _State.TEXT
        self._buffer = ""
        self._make_id = make_id
        self.calls = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text and call pieces that ``text`` completes."""
        self._buffer += text
        content: list[str] = []
        pieces: list[ToolCallDelta] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            step = {_State.TEXT: self._text, _State.NAME: self._name,
                    _State.ARGUMENTS: self._arguments, _State.CLOSE: self._close,
                    _State.BETWEEN: self._between}[self._state]
            step(content, pieces)
            if (self._state, len(self._buffer)) == before:
                break  # waits for more text
        return "".join(content), pieces

    def finish(self) -> str:
        """Content held back at the end (a partial marker, or a broken call's text)."""
        rest, self._buffer = self._buffer, ""
        if self._state is _State.BETWEEN and rest.isspace():
            return ""
        return rest if self._state in (_State.TEXT, _State.BETWEEN) else ""

    # ---------------------------------------------------------------- states

    def _text(self, content: list[str], pieces: list[ToolCallDelta]) -> None:
        at = self._buffer.find(CALL_OPEN)
        if at >= 0:
            content.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(CALL_OPEN):]
            self._state = _State.NAME
            return
        keep = _partial_suffix(self._buffer, CALL_OPEN)
        content.append(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _name(self, content: list[str], pieces: list[ToolCallDelta]) -> None:
        if not self._buffer.startswith(NAME_PREFIX[:len(self._buffer)]):
            self._state = _State.TEXT  # not our envelope: text after all
            content.append(CALL_OPEN)
            return
        end = self._buffer.find(ARGUMENTS_PREFIX, len(NAME_PREFIX))
        if end < 0:
            return
        name = self._buffer[len(NAME_PREFIX):end]
        self._buffer = self._buffer[end + len(ARGUMENTS_PREFIX):]
        pieces.append(ToolCallDelta(self.calls, self._make_id(), name, ""))
        self.calls += 1
        self._state = _State.ARGUMENTS
        self._depth, self._in_string, self._escaped = 0, False, False

    def _arguments(self, content: list[str], pieces: list[ToolCallDelta]) -> None:
        end = self._scan()
        taken = self._buffer[:end]
        self._buffer = self._buffer[end:]
        if taken:
            pieces.append(ToolCallDelta(self.calls - 1, arguments=taken))
        if self._depth == 0 and taken:
            self._state = _State.CLOSE

    def _scan(self) -> int:
        """Characters of the buffer that belong to the arguments object."""
        for i, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self._buffer)

    def _close(self, content: list[str], pieces: list[ToolCallDelta]) -> None:
        if len(self._buffer) < len(CALL_CLOSE):
            if not CALL_CLOSE.startswith(self._buffer):
                self._state = _State.TEXT
            return
        if self._buffer.startswith(CALL_CLOSE):
            self._buffer = self._buffer[len(CALL_CLOSE):]
            self._state = _State.BETWEEN
        else:
            self._state = _State.TEXT

    def _between(self, content: list[str], pieces: list[ToolCallDelta]) -> None:
        self._state = _State.TEXT  # "\n<tool_call>" or text: TEXT finds the marker
        if self._buffer.startswith("\n") and CALL_OPEN.startswith(
                self._buffer[1:1 + len(CALL_OPEN)]) and len(self._buffer) <= len(CALL_OPEN):
            self._state = _State.BETWEEN  # "\n<tool_c": wait
            return
        if self._buffer.startswith("\n" + CALL_OPEN):
            self._buffer = self._buffer[1:]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


__all__ = ["ToolCallParser", "new_call_id"]
