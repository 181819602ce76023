"""Tool calling's typed values (OpenAI's ``tools``, ``tool_choice``,
``tool_calls``), converted from and to ``llmesh.v1`` at the edges.

Both edges (gRPC ``Chat.tools`` and OpenAI's body, which the router turns into
the same protobuf) end here: the router validates once
(:mod:`services.router.tools.validate`) and passes these values inward.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from llmesh.v1 import common_pb2, generation_pb2


class ToolChoiceMode(enum.Enum):
    """How the model may use the tools (OpenAI's ``tool_choice``)."""

    AUTO = "auto"  # text, or calls (constrained once the call marker is written)
    NONE = "none"  # text only; the tools are still rendered (vLLM's behaviour)
    REQUIRED = "required"  # one or more calls, no text
    NAMED = "named"  # exactly one call of ``ToolChoice.function_name``


_MODE_FROM_PB = {
    generation_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO,
    generation_pb2.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
    generation_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED,
}
_MODE_TO_PB = {mode: value for value, mode in _MODE_FROM_PB.items()}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``mode``, and for NAMED the function the model must call."""

    mode: ToolChoiceMode
    function_name: str = ""

    @classmethod
    def from_pb(cls, pb: generation_pb2.ToolChoice, *, has_tools: bool) -> ToolChoice:
        """Unset: AUTO with tools, NONE without (OpenAI's defaults). An unknown
        mode value is kept as UNSPECIFIED's default; validation names it."""
        which = pb.WhichOneof("choice")
        if which == "function_name":
            return cls(ToolChoiceMode.NAMED, pb.function_name)
        if which == "mode" and pb.mode in _MODE_FROM_PB:
            return cls(_MODE_FROM_PB[pb.mode])
        return cls(ToolChoiceMode.AUTO if has_tools else ToolChoiceMode.NONE)

    def to_pb(self) -> generation_pb2.ToolChoice:
        if self.mode is ToolChoiceMode.NAMED:
            return generation_pb2.ToolChoice(function_name=self.function_name)
        return generation_pb2.ToolChoice(mode=_MODE_TO_PB[self.mode])


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A function the model may call.

    Attributes:
      name: the function's name ([A-Za-z0-9_-], 1..64).
      description: what it does, for the model ("" none).
      parameters_schema: the JSON schema of its arguments object, as JSON text
        (``{"type": "object"}`` when the client gave none).
    """

    name: str
    description: str
    parameters_schema: str

    @classmethod
    def from_pb(cls, pb: generation_pb2.FunctionTool) -> FunctionTool:
        return cls(pb.name, pb.description, pb.parameters_json or '{"type": "object"}')

    def to_pb(self) -> generation_pb2.FunctionTool:
        return generation_pb2.FunctionTool(name=self.name, description=self.description,
                                           parameters_json=self.parameters_schema)

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's tool object ``{"type": "function", "function": {"name",
        "description" (when set), "parameters"}}``, the shape transformers'
        ``apply_chat_template(tools=...)`` and the Hermes format take."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters_schema)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made (or made earlier, in the chat history).

    Attributes:
      id: ``call_`` + random characters.
      name: the function's name.
      arguments_json: the arguments object as JSON text, exactly as generated.
    """

    id: str
    name: str
    arguments_json: str

    @classmethod
    def from_pb(cls, pb: common_pb2.ToolCall) -> ToolCall:
        return cls(pb.id, pb.name, pb.arguments)

    def to_pb(self) -> common_pb2.ToolCall:
        return common_pb2.ToolCall(id=self.id, name=self.name, arguments=self.arguments_json)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a call in a streamed answer: ``id`` and ``name`` on the first
    piece of call ``index`` ("" after), ``arguments`` the next piece of its
    arguments JSON (pieces of one index concatenate to ``arguments_json``)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""

    @classmethod
    def from_pb(cls, pb: generation_pb2.ToolCallDelta) -> ToolCallDelta:
        return cls(pb.index, pb.id, pb.name, pb.arguments)

    def to_pb(self) -> generation_pb2.ToolCallDelta:
        return generation_pb2.ToolCallDelta(index=self.index, id=self.id, name=self.name,
                                            arguments=self.arguments)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools, validated.

    Attributes:
      tools: the functions, names unique.
      choice: how the model may use them.
      parallel: more than one call allowed (AUTO and REQUIRED; NAMED is one call).
    """

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def may_call(self) -> bool:
        """Whether the output may hold calls (tools given and choice not NONE)."""
        return bool(self.tools) and self.choice.mode is not ToolChoiceMode.NONE

    @property
    def calls_only(self) -> bool:
        """Whether the output is calls and nothing else (REQUIRED or NAMED)."""
        return self.choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)


__all__ = ["FunctionTool", "ToolCall", "ToolCallDelta", "ToolChoice", "ToolChoiceMode",
           "ToolRequest"]
