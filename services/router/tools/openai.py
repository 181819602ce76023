"""OpenAI's tool-calling shapes ↔ ``llmesh.v1`` (the OpenAI edge's part of tools).

Request (OpenAI API reference, "Chat": ``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls``, ``tool`` messages):

* ``tools: [{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}]`` → ``chat.tools`` (``strict`` is accepted:
  calls are always schema-valid here);
* ``tool_choice``: ``"none"`` | ``"auto"`` | ``"required"`` |
  ``{"type": "function", "function": {"name"}}`` → ``chat.tool_choice``;
* ``parallel_tool_calls`` → ``chat.parallel_tool_calls``;
* an assistant message's ``tool_calls: [{"id", "type": "function",
  "function": {"name", "arguments"}}]`` and a ``tool`` message's
  ``tool_call_id`` → the ``ChatMessage`` fields of the same names.

Response: ``message.tool_calls`` (``content`` null when the answer is only
calls) and, streamed, ``delta.tool_calls: [{"index", "id", "type",
"function": {"name", "arguments"}}]`` with ``id``/``type``/``name`` on the
first piece of a call only.

Refusals name the OpenAI parameter (``tools[0].function.parameters``);
:func:`openai_param` maps the shared validation's field names back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmesh.v1 import common_pb2, generation_pb2

from services.common.sampling import InvalidRequestError
from services.common.wire.tools import ToolCallDelta

_MODES = {"none": generation_pb2.TOOL_CHOICE_MODE_NONE,
          "auto": generation_pb2.TOOL_CHOICE_MODE_AUTO,
          "required": generation_pb2.TOOL_CHOICE_MODE_REQUIRED}


def parse_tools(data: Mapping[str, Any], chat: generation_pb2.Chat) -> None:
    """Fills ``chat``'s tool fields from a chat body.

    Raises:
      InvalidRequestError: a shape OpenAI does not define, naming the parameter.
    """
    tools = data.get("tools", [])
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be an array of tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(where, 'must be {"type": "function", "function": {...}}'
                                             " (only function tools are supported)")
        function = tool["function"]
        extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if extra:
            raise InvalidRequestError(f"{where}.function.{extra[0]}", "is not supported")
        name, description = function.get("name"), function.get("description") or ""
        if not isinstance(name, str) or not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.name",
                                      "name and description must be strings")
        parameters = function.get("parameters")
        chat.tools.add(name=name, description=description,
                       parameters_json="" if parameters is None else json.dumps(parameters))
    if "tool_choice" in data:
        _tool_choice(data["tool_choice"], chat.tool_choice)
    if "parallel_tool_calls" in data:
        value = data["parallel_tool_calls"]
        if not isinstance(value, bool):
            raise InvalidRequestError("parallel_tool_calls", "must be true or false")
        chat.parallel_tool_calls = value


def _tool_choice(value: object, out: generation_pb2.ToolChoice) -> None:
    if isinstance(value, str) and value in _MODES:
        out.mode = _MODES[value]
        return
    if isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        out.function_name = value["function"]["name"]
        return
    raise InvalidRequestError("tool_choice", '"none", "auto", "required" or {"type": '
                                             '"function", "function": {"name": ...}}')


#: Keys a message may carry besides role and content.
MESSAGE_KEYS = frozenset({"tool_calls", "tool_call_id"})


def parse_message_tools(message: Mapping[str, Any], where: str,
                        out: common_pb2.ChatMessage) -> None:
    """Fills ``out``'s ``tool_calls`` / ``tool_call_id`` from an OpenAI message."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}.tool_calls", "must be an array of tool calls")
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str) \
                or not isinstance(call.get("id", ""), str):
            raise InvalidRequestError(at, 'must be {"id", "type": "function", "function": '
                                          '{"name", "arguments": a JSON string}}')
        out.tool_calls.add(id=call.get("id", ""), name=function["name"],
                           arguments=function["arguments"])
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id", "must be a string")
        out.tool_call_id = call_id


_FIELD = re.compile(r"chat\.tools\[(\d+)\]\.(name|parameters_json|description)")
_CALL_FIELD = re.compile(r"chat\.messages\[(\d+)\]\.tool_calls\[(\d+)\]\.(name|arguments)")


def openai_param(field: str) -> str | None:
    """The OpenAI parameter of a tool field of the shared validation, or None
    when ``field`` is not one (``chat.tools[1].parameters_json`` →
    ``tools[1].function.parameters``; ``chat.tool_choice...`` → ``tool_choice``)."""
    call = _CALL_FIELD.fullmatch(field)
    if call:  # the OpenAI message nests a call's name and arguments in `function`
        return f"messages[{call[1]}].tool_calls[{call[2]}].function.{call[3]}"
    match = _FIELD.match(field)
    if match:
        name = "parameters" if match[2] == "parameters_json" else match[2]
        return f"tools[{match[1]}].function.{name}"
    for prefix, param in (("chat.tools", "tools"), ("chat.tool_choice", "tool_choice"),
                          ("chat.parallel_tool_calls", "parallel_tool_calls")):
        if field.startswith(prefix):
            return param
    return None


def delta_body(pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """``delta.tool_calls`` of a stream chunk."""
    out = []
    for piece in pieces:
        body: dict[str, Any] = {"index": piece.index}
        function: dict[str, Any] = {"arguments": piece.arguments}
        if piece.id:
            body["id"], body["type"] = piece.id, "function"
            function["name"] = piece.name
        body["function"] = function
        out.append(body)
    return out


def message_body(pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a whole answer, from all its pieces."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                              "function": {"name": piece.name,
                                                           "arguments": ""}})
        call["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


__all__ = ["MESSAGE_KEYS", "delta_body", "message_body", "openai_param",
           "parse_message_tools", "parse_tools"]
