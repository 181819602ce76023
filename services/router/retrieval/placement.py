"""Where the passages go in a chat, and the exact text they take.

The passages become ONE user message inserted just before the last user turn
(the query), after the system prompt and the conversation so far: the prompt
up to that point is byte-for-byte the previous turn's prompt and answer, so
the engine's prefix cache serves it (docs/architecture.md
"Retrieval-augmented requests").

The message's text is stable (the same chunks give the same bytes)::

    Passages retrieved for the next message (collection "<name>"):

    [1] <chunk id>
    <chunk text>

    [2] <chunk id>
    <chunk text>

A conversation's earlier passages are ordinary history: the response returns
the inserted text (``RetrievalUsed.passages_message``) and a client that sends
it back at the same place in its history keeps every earlier turn's prefix
hit; a turn that asks again gets its own message before its own last turn;
a turn that does not ask gets nothing inserted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.wire.chat import ChatMessage
from services.router.retrieval.spec import USER_ROLE


@dataclass(frozen=True)
class Passage:
    """One retrieved chunk as the prompt and the response use it.

    Attributes:
      chunk_id: ``<document id>#<chunk index>``.
      document_id: the document it came from.
      text: the chunk's text.
      score: cosine similarity in [-1, 1].
    """

    chunk_id: str
    document_id: str
    text: str
    score: float


def passages_text(collection: str, passages: Sequence[Passage]) -> str:
    """The inserted message's content ("" when there are no passages)."""
    if not passages:
        return ""
    blocks = [f"[{i}] {p.chunk_id}\n{p.text.strip()}" for i, p in enumerate(passages, 1)]
    return "\n\n".join([f'Passages retrieved for the next message (collection '
                        f'"{collection}"):', *blocks])


def with_passages(messages: Sequence[ChatMessage], query_index: int,
                  text: str) -> tuple[ChatMessage, ...]:
    """``messages`` with a user message of ``text`` inserted just before
    ``messages[query_index]`` (unchanged when ``text`` is empty)."""
    if not text:
        return tuple(messages)
    return (*messages[:query_index], ChatMessage(USER_ROLE, text), *messages[query_index:])
