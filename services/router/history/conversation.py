"""A conversation as history compaction sees it: system turns, then the rest.

* :func:`split`: the leading ``system`` messages (kept whole, never
  summarised) and the turns after them.
* :func:`boundaries`: where a summary may end (before a ``user`` turn of
  the earlier turns, never in the current exchange), each with the chained
  hash of the prefix it covers:
  ``h_0 = SHA-256(domain, model, summariser, system turns)`` and ``h_k =
  SHA-256(h_{k-1}, turn k)``, each message encoded length-prefixed (role,
  content, tool call id, tool calls), so equal conversations give equal
  hashes in every router and process.
* :func:`rewrite`: the prompt's messages with the summary in the system
  turn's place: appended to the (first) system message after
  :data:`SUMMARY_HEADER`, or as a system message of its own when the chat
  has none; then the turns the summary does not cover.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.wire.chat import ChatMessage

#: Marks the summary in the system turn (the model reads it as context).
SUMMARY_HEADER = "Summary of the earlier conversation (older turns are not shown):"
_DOMAIN = b"llmesh.history-prefix.v1\x00"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Conversation:
    """A chat split for compaction.

    Attributes:
      system: the leading ``system`` messages.
      turns: every message after them, oldest first (the last is the one to answer).
    """

    system: tuple[ChatMessage, ...]
    turns: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class Boundary:
    """A place a summary may end: it covers ``turns[:end]``, named by ``prefix_hash``."""

    end: int
    prefix_hash: bytes


def split(messages: Sequence[ChatMessage]) -> Conversation:
    """The leading system messages and the turns after them."""
    count = 0
    while count < len(messages) and messages[count].role == "system":
        count += 1
    return Conversation(tuple(messages[:count]), tuple(messages[count:]))


def earlier_turns(messages: Sequence[ChatMessage]) -> int:
    """How many of ``messages`` after the leading system ones come before the
    current exchange (the messages after the last ``assistant`` one): the
    ones a history budget may drop (or a summary replace)."""
    return _last_reply(split(messages).turns) + 1


def _last_reply(turns: Sequence[ChatMessage]) -> int:
    """The index of the last ``assistant`` message of ``turns`` (-1: none)."""
    return max((i for i, m in enumerate(turns) if m.role == "assistant"), default=-1)


def _field(text: str) -> bytes:
    data = text.encode()
    return _LEN.pack(len(data)) + data


def _message_bytes(message: ChatMessage) -> bytes:
    parts = [_field(message.role), _field(message.content), _field(message.tool_call_id),
             _LEN.pack(len(message.tool_calls))]
    for call in message.tool_calls:
        parts += [_field(call.id), _field(call.name), _field(call.arguments_json)]
    return b"".join(parts)


def boundaries(conversation: Conversation, *, model: str, summarizer: str
               ) -> list[Boundary]:
    """The places a summary may end, shortest prefix first: before each ``user``
    turn but the first one, within the earlier turns (:func:`earlier_turns`):
    the current exchange is never covered. It may hold what the router put
    there for this request only, the retrieval passages inserted before the
    last user turn, which are not the client's history: a summary of them
    would be keyed by messages the next turn does not send, and never found."""
    digest = hashlib.sha256(_DOMAIN + _field(model) + _field(summarizer)
                            + _LEN.pack(len(conversation.system)))
    for message in conversation.system:
        digest.update(_message_bytes(message))
    chain = digest.digest()
    found: list[Boundary] = []
    turns = conversation.turns
    for end, message in enumerate(turns[:_last_reply(turns) + 1], start=1):
        chain = hashlib.sha256(chain + _message_bytes(message)).digest()
        if end < len(turns) and turns[end].role == "user":
            found.append(Boundary(end, chain))
    return found


def rewrite(conversation: Conversation, summary: str, start: int) -> tuple[ChatMessage, ...]:
    """The prompt's messages: system turns with ``summary`` in the first one
    (or a system turn of its own), then ``turns[start:]``. Without a summary
    (``start`` 0): the conversation as it came."""
    if start == 0:
        return conversation.system + conversation.turns
    block = f"{SUMMARY_HEADER}\n{summary.strip()}"
    system = list(conversation.system)
    if system:
        first = system[0]
        system[0] = ChatMessage(first.role, f"{first.content}\n\n{block}", first.tool_calls,
                                first.tool_call_id)
    else:
        system = [ChatMessage("system", block)]
    return tuple(system) + conversation.turns[start:]
