"""Chat turns and the prompt a chat template makes of them (router ↔ tokenizer:
``ApplyChatTemplate``). Both ends import these; roles and contents are checked
by the tokenizer (the template's owner), not here."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.v1 import common_pb2, tokenizer_pb2

from services.common.wire.tools import ToolCall


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn.

    Attributes:
      role: one of the tokenizer's ``chat_roles`` (``system``, ``user``,
        ``assistant``, ``tool`` by default).
      content: UTF-8 text of the turn.
      tool_calls: an assistant turn's calls (the router renders them into
        ``content`` before a template sees the turn: :mod:`services.router.tools`).
      tool_call_id: a ``tool`` turn's call id ("" none).
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    @classmethod
    def from_pb(cls, pb: common_pb2.ChatMessage) -> ChatMessage:
        return cls(pb.role, pb.content, tuple(ToolCall.from_pb(c) for c in pb.tool_calls),
                   pb.tool_call_id)

    def to_pb(self) -> common_pb2.ChatMessage:
        return common_pb2.ChatMessage(role=self.role, content=self.content,
                                      tool_calls=[c.to_pb() for c in self.tool_calls],
                                      tool_call_id=self.tool_call_id)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered and tokenized chat prompt.

    Attributes:
      token_ids: prompt token ids, ready for the engine.
      num_dropped_messages: how many of the oldest non-system messages were
        left out to fit the token budget.
    """

    token_ids: tuple[int, ...]
    num_dropped_messages: int

    @classmethod
    def from_pb(cls, pb: tokenizer_pb2.ApplyChatTemplateResponse) -> ChatPrompt:
        return cls(tuple(pb.token_ids), pb.num_dropped_messages)

    def to_pb(self) -> tokenizer_pb2.ApplyChatTemplateResponse:
        return tokenizer_pb2.ApplyChatTemplateResponse(
            token_ids=self.token_ids, num_dropped_messages=self.num_dropped_messages)
